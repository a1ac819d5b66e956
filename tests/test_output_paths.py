"""Every path a verb writes is checked before it writes (hf_tune/runtime/output_paths.py): each `hf-tune` verb that
takes --out refuses a folder where a file goes (or the reverse), a place that cannot be written, its own input and a
file it did not write, with exit 2, one named error and its fix, no traceback, and nothing written or changed."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from conftest import DATA, REPO

from hf_tune.commands.cli import VERBS, main
from hf_tune.workflows.generate import generate_file

UNWRITABLE = Path("/proc/hf_tune-out/x")  # /proc takes no new file, whoever runs the suite (root included)


def positional(name: str, verb, tmp_path: Path) -> list[str]:
    """The least a verb's command line needs before its --out (the check comes first: nothing else is read)."""
    args = ["recipes/llm_lora.yaml"] if verb.reads_recipe else []
    for flags, settings in verb.options:
        if flags[0] == "run_dir":
            args.append(str(tmp_path / "no-run"))
        elif flags[0] == "run_dirs":
            args.append(str(tmp_path / "no-run"))
        elif flags[0] == "model":
            args.append("embedded:SmolLM2-135M-Instruct")
        elif flags[0] == "--input":
            args += ["--input", str(DATA / "arithmetic_prompts.jsonl")]
    return [name, *args]


def snapshot(folder: Path) -> dict[str, str]:
    return {str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(folder.rglob("*")) if path.is_file()}


OUT_VERBS = sorted(name for name, verb in VERBS.items() if any("--out" in flags for flags, _ in verb.options))


def test_the_verbs_that_write_name_what_they_write():
    assert {"plan", "profile", "init", "merge", "export", "reproduce", "generate", "compare"} <= set(OUT_VERBS)
    assert all(VERBS[name].output is not None for name in OUT_VERBS)


@pytest.mark.parametrize("name", OUT_VERBS)
def test_a_bad_out_is_refused_before_any_work(name, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    verb = VERBS[name]
    users = tmp_path / "users"
    users.mkdir()
    (users / "notes.txt").write_text("a user's file\n")
    (users / "folder").mkdir()
    bad = {"unwritable": str(UNWRITABLE), "under a file": str(users / "notes.txt" / "x")}
    if verb.output.kind == "file":
        bad.update({"a folder": str(users / "folder"), "a file it did not write": str(users / "notes.txt")})
    else:
        bad["a file"] = str(users / "notes.txt")
    command = positional(name, verb, tmp_path)
    if "input" in verb.output.inputs:
        bad["its own input"] = command[command.index("--input") + 1]
    before, repo_before = snapshot(tmp_path), snapshot(REPO / "examples" / "data")
    for case, out in bad.items():
        with pytest.raises(SystemExit) as refused:
            main([*command, "--out", out])
        err = capsys.readouterr().err
        assert refused.value.code == 2, (case, err)
        assert err.startswith(f"hf_tune: error: --out {out}: ") and "\n  fix: " in err, (case, err)
        assert "Traceback" not in err and err.count("hf_tune: error:") == 1, (case, err)
    assert snapshot(tmp_path) == before and snapshot(REPO / "examples" / "data") == repo_before


def answered(rows: list[dict], answer: str) -> str:
    return "".join(json.dumps({**row, "answer": answer}) + "\n" for row in rows)


def test_generate_continues_only_its_own_job_and_never_rewrites_another_s(tmp_path):
    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    first.write_text('{"prompt": "What is 2 + 2?"}\n{"prompt": "Name a colour."}\n')
    second.write_text('{"prompt": "Spell cat."}\n')
    answers = tmp_path / "answers.jsonl"  # the first job's answers, finished
    answers.write_text(answered([{"prompt": "What is 2 + 2?"}, {"prompt": "Name a colour."}], "4"))
    kept = answers.read_bytes()
    with pytest.raises(Exception) as refused:  # another input's job into the first job's file
        generate_file(tmp_path / "no-run", second, answers)
    assert "is not a file this command wrote" in str(refused.value) and answers.read_bytes() == kept
    with pytest.raises(Exception) as refused:  # into its own input
        generate_file(tmp_path / "no-run", second, second)
    assert "own input" in str(refused.value) and second.read_text() == '{"prompt": "Spell cat."}\n'
    # the same job again: already answered, nothing loaded, the file left byte for byte
    result = generate_file(tmp_path / "no-run", first, answers)
    assert result["resumed_after"] == 2 and answers.read_bytes() == kept


def test_generate_refuses_a_role_the_chat_template_does_not_render(smol_tokenizer):
    from hf_tune.errors import HfTuneError
    from hf_tune.workflows.generate import refuse_unknown_roles

    fine = [{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}]
    refuse_unknown_roles(smol_tokenizer, fine, "p.jsonl")  # SmolLM2's ChatML renders both
    with pytest.raises(HfTuneError) as refused:  # ChatML would print any role; the model never saw this one
        refuse_unknown_roles(smol_tokenizer, [*fine, {"messages": [{"role": "narrator", "content": "Once"}]}],
                             "p.jsonl")
    assert "line 2: role 'narrator'" in str(refused.value) and "user, assistant" in str(refused.value)
