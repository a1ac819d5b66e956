"""A run folder that is broken or half-written (hf_tune/records/run_reader.py): every verb that reads one (report,
compare, chat, merge, push, register, eval) ends in one error naming the file and how to recover, exit status 2, no
traceback, nothing written, before any model loads. One LoRA run of the tiny Llama, trained once in-process, is
copied and broken per case."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
from conftest import chat_recipe

from hf_tune.commands.cli import main
from hf_tune.errors import HfTuneError


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, tiny_llama_dir) -> Path:
    """A finished 2-step LoRA run with a complete checkpoint at each step."""
    from hf_tune.assembly.loading import load_recipe
    from hf_tune.workflows.train import train

    out = tmp_path_factory.mktemp("reader") / "run"
    raw = chat_recipe(tiny_llama_dir, out, save_strategy="steps", save_steps=1)
    raw["lora"] = {"r": 2, "target_modules": ["q_proj"]}
    train(load_recipe(raw))
    return out


def truncate(path: Path) -> None:
    path.write_text(path.read_text()[: len(path.read_text()) // 2])


CASES = {  # case -> (how the copy is broken, argv after the run folder's verb, what the message names)
    "report, trainer_state.json cut short": (lambda r: truncate(r / "trainer_state.json"), ["report"],
                                              ["trainer_state.json: unreadable", "checkpoint-2"]),
    "compare, run.json cut short": (lambda r: truncate(r / "run.json"), ["compare"], ["run.json: unreadable"]),
    "compare, recipe.yaml not YAML": (lambda r: ((r / "run.json").unlink(), (r / "recipe.yaml").write_text(
        "model: [unclosed\n")), ["compare"], ["recipe.yaml: unreadable"]),
    "compare, eval_scores.jsonl line cut short": (lambda r: (r / "eval_scores.jsonl").write_text(
        '{"step": 1, "scores": {}}\n{"step": 2, "sco'), ["compare"], ["eval_scores.jsonl: unreadable", "line 2"]),
    "chat, adapter_config.json cut short": (lambda r: truncate(r / "adapter_config.json"), ["chat", "--prompt", "hi"],
                                             ["adapter_config.json: unreadable", "checkpoint-2"]),
    "chat, adapter weights missing": (lambda r: (r / "adapter_model.safetensors").unlink(), ["chat", "--prompt", "hi"],
                                       ["adapter's weights are missing", "checkpoint-2"]),
    "chat, tokenizer missing": (lambda r: (r / "tokenizer_config.json").unlink(), ["chat", "--prompt", "hi"],
                                ["tokenizer (or processor) files are missing"]),
    "chat, a classifier's run": (lambda r: (r / "recipe.yaml").write_text((r / "recipe.yaml").read_text().replace(
        "task: causal_lm", "task: sequence_classification", 1)), ["chat", "--prompt", "hi"],
        ["a sequence_classification run", "chat and eval talk to a causal LM"]),
    "merge, adapter_config.json not a mapping": (lambda r: (r / "adapter_config.json").write_text("[1, 2]"),
                                                 ["merge"], ["adapter_config.json: unreadable", "a list"]),
    "merge, recipe.yaml not YAML": (lambda r: (r / "recipe.yaml").write_text("model: {a: [}\n"), ["merge"],
                                    ["recipe.yaml: unreadable"]),
    "push, recipe.yaml missing": (lambda r: ((r / "recipe.yaml").unlink(), (r / "run.json").unlink()),
                                  ["push", "--repo-id", "me/x"], ["recipe.yaml: missing"]),
    "register, run.json cut short": (lambda r: truncate(r / "run.json"), ["register", "--name", "x"],
                                     ["run.json: unreadable"]),
    "export, adapter weights cut short": (lambda r: (r / "adapter_model.safetensors").write_bytes(
        (r / "adapter_model.safetensors").read_bytes()[:200]), ["export"],
        ["adapter_model.safetensors: unreadable", "checkpoint-2"]),
    "merge, adapter weights cut short in their tensors": (lambda r: (r / "adapter_model.safetensors").write_bytes(
        (r / "adapter_model.safetensors").read_bytes()[:-16]), ["merge"],
        ["adapter_model.safetensors: unreadable", "its tensors need"]),
    "eval --checkpoint, run.json is fine but the folder is a file": (
        lambda r: (shutil.rmtree(r), r.write_text("not a folder")), ["eval", "--checkpoint", "1"],
        ["a file, not a run folder"]),
}


@pytest.mark.parametrize("case", CASES)
def test_a_broken_run_folder_is_one_named_error_with_nothing_written(case, trained_run, tmp_path, monkeypatch, capsys):
    from hf_tune.trainer.checkpoints import last_complete_checkpoint

    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    assert last_complete_checkpoint(run).name == "checkpoint-2"
    breaks, argv, named = CASES[case]
    breaks(run)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    monkeypatch.chdir(tmp_path)
    verb, *options = argv
    with pytest.raises(SystemExit) as stopped:
        main([verb, str(run), *options])
    err = capsys.readouterr().err
    assert stopped.value.code == 2, err
    assert "Traceback" not in err and err.count("error:") == 1, err
    assert all(part in err for part in named), err
    assert "fix:" in err
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # nothing written


def test_eval_watch_of_a_folder_that_never_appears_stops_naming_it(tmp_path, capsys):
    """A watcher may start before its run (the folder appears later), so a missing folder is waited for --wait
    seconds; one whose parent does not exist is a mistyped path, refused at once."""
    import time

    for folder, wait, said in ((tmp_path / "nowhere" / "run", "600", "no such folder, nor its parent"),
                               (tmp_path / "not_yet", "0.3", "did not appear within 0.3 s")):
        began = time.monotonic()
        with pytest.raises(SystemExit) as stopped:
            main(["eval", str(folder), "--watch", "--wait", wait, "--interval", "0.1", "--tasks", "hf_tune_arithmetic"])
        err = capsys.readouterr().err
        assert stopped.value.code == 2 and said in err and "fix:" in err, err
        assert time.monotonic() - began < 60 and not folder.exists()


def test_a_crash_that_cut_the_manifest_short_is_mended_by_the_rerun_its_error_names(trained_run, tmp_path, caplog,
                                                                                   capsys):
    """A run killed after checkpoint-1 while run.json was being written: the run is not taken for finished, and the
    rerun the error prescribes resumes from checkpoint-1, trains step 2 and writes run.json again."""
    import json

    from hf_tune.assembly.loading import load_recipe
    from hf_tune.workflows.train import train

    run = tmp_path / "run"
    run.mkdir()
    for name in ("checkpoint-1", "recipe.yaml", "run.json"):
        (shutil.copytree if name.startswith("checkpoint") else shutil.copy2)(trained_run / name, run / name)
    truncate(run / "run.json")
    with pytest.raises(SystemExit):
        main(["compare", str(run)])
    fix = capsys.readouterr().err.split("fix: ", 1)[1]
    assert fix.startswith(f"`python -m hf_tune.run {run / 'recipe.yaml'}` resumes from checkpoint-1"), fix
    with caplog.at_level(logging.INFO):
        train(load_recipe(run / "recipe.yaml", [f"training.output_dir={run}"]))
    assert "run.json is unreadable" in caplog.text and "Resuming from" in caplog.text
    assert json.loads((run / "run.json").read_text())["end_time"]
    assert json.loads((run / "trainer_state.json").read_text())["global_step"] == 2


def test_the_intact_run_reads_as_the_verbs_need_it(trained_run):
    from hf_tune.records.run_reader import open_run

    run = open_run(trained_run, needs=("manifest", "recipe", "trainer_state", "adapter", "weights", "tokenizer"))
    assert run.weights() == "adapter"
    assert run.recipe()["lora"]["r"] == 2 and run.manifest()["end_time"]
    assert [e["step"] for e in run.trainer_state()["log_history"] if "loss" in e] == [1, 2]


def test_a_run_killed_after_its_last_checkpoint_is_not_trained_a_step_further(trained_run, tmp_path):
    """Killed after checkpoint-2 (its max_steps) was saved, before the run ended: Trainer would resume it and train a
    third step (measured: global_step 3), changing the model. The rerun is refused, naming the checkpoint to use."""
    from hf_tune.assembly.loading import load_recipe
    from hf_tune.errors import RecipeError
    from hf_tune.workflows.train import train

    run = tmp_path / "run"
    run.mkdir()
    for name in ("checkpoint-1", "checkpoint-2", "recipe.yaml"):
        (shutil.copytree if name.startswith("checkpoint") else shutil.copy2)(trained_run / name, run / name)
    weights = (run / "checkpoint-2" / "adapter_model.safetensors").read_bytes()
    with pytest.raises(RecipeError) as refused:
        train(load_recipe(run / "recipe.yaml", [f"training.output_dir={run}"]))
    assert refused.value.key == "training.max_steps" and "checkpoint-2 is already at step 2 of 2" in str(refused.value)
    assert f"use {run / 'checkpoint-2'} as the trained model" in str(refused.value)
    assert (run / "checkpoint-2" / "adapter_model.safetensors").read_bytes() == weights and not list(run.glob("*.json"))


def test_a_merge_that_fails_midway_leaves_the_folder_as_it_was(trained_run, tmp_path, monkeypatch):
    """The merge writes aside and renames once whole: a disk that fills after the shards are written (simulated: the
    one environment failure a test cannot make) leaves no partial folder, and an earlier merge stands untouched."""
    import errno
    import hashlib

    import hf_tune.workflows.merge_run as hub

    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    first = hub.merge(run)
    assert first["merged_dir"] == str(run / "merged") and (run / "merged" / "config.json").is_file()
    digest = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in (run / "merged").iterdir()}
    real = hub.write_merged_shards

    def fills_the_disk(*args, **kwargs):
        real(*args, **kwargs)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(hub, "write_merged_shards", fills_the_disk)
    with pytest.raises(OSError, match="No space left"):
        hub.merge(run)
    assert sorted(p.name for p in run.iterdir() if "merged" in p.name) == ["merged"]  # no .merged.partial
    assert {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in (run / "merged").iterdir()} == digest
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    with pytest.raises(HfTuneError, match="exists and is not a merged model"):  # a folder of the user's: never removed
        hub.merge(run, out=tmp_path / "notes")
    assert (tmp_path / "notes" / "todo.txt").read_text() == "mine"
