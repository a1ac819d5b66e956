"""hf-tune reproduce: a finished LoRA run of the tiny Llama trained again from its folder alone gives the same weights
bit for bit (checked here tensor by tensor, apart from the verb's own comparison); after a data file changes, the
rerun is reported as not reproduced, with the data fingerprint named as what differed, and the weights really differ."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import DATA, chat_recipe
from safetensors.torch import load_file

from hf_tune import load_recipe, train
from hf_tune.commands.cli import main

ADAPTER = "adapter_model.safetensors"


def same_tensors(first, second) -> bool:
    a, b = load_file(first / ADAPTER), load_file(second / ADAPTER)
    return set(a) == set(b) and all(a[k].equal(b[k]) for k in a)


def test_a_rerun_from_the_folder_matches_and_a_changed_data_file_is_named(tmp_path, tiny_llama_dir, capsys):
    chats = tmp_path / "chats.jsonl"
    lines = (DATA / "chat_demo.jsonl").read_text().splitlines()[:24]
    chats.write_text("\n".join(lines) + "\n")
    raw = chat_recipe(tiny_llama_dir, tmp_path / "run", max_steps=4, learning_rate=2e-2, seed=7)
    raw["data"]["train"]["path"] = str(chats)
    raw["lora"] = {"r": 4, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.1}  # dropout draws from the RNG
    train(load_recipe(raw))
    run = tmp_path / "run"

    capsys.readouterr()
    main(["reproduce", str(run)])
    report = capsys.readouterr().out
    assert report.rstrip().endswith("reproduced: yes"), report
    assert "weights: identical" in report and "identical at all 4 logged steps" in report
    assert same_tensors(run, tmp_path / "run-reproduced")
    assert "seed 7" in report and "what differed between the runs: nothing" in report

    with pytest.raises(SystemExit) as refused:  # a usage error: exit 2, the fix named
        main(["reproduce", str(run), "--out", str(tmp_path / "run-reproduced")])
    error = capsys.readouterr().err
    assert refused.value.code == 2 and "holds a run already" in error and f"--against {tmp_path}" in error

    edited = tmp_path / "edited"  # the same run, as if trained with another torch: still the same weights
    shutil.copytree(tmp_path / "run-reproduced", edited)
    manifest = json.loads((edited / "run.json").read_text())
    manifest["packages"]["torch"] = "0.0.1"
    (edited / "run.json").write_text(json.dumps(manifest))
    main(["reproduce", str(run), "--against", str(edited)])
    report = capsys.readouterr().out
    assert "package torch: " in report and "against 0.0.1" in report and report.rstrip().endswith("reproduced: yes")

    chats.write_text("\n".join(line.replace('"assistant", "content": "', '"assistant", "content": "Well, ')
                               for line in lines) + "\n")
    with pytest.raises(SystemExit) as failed:
        main(["reproduce", str(run), "--out", str(tmp_path / "after-edit")])
    report = capsys.readouterr().out
    assert failed.value.code == 1 and report.rstrip().endswith("reproduced: no"), report
    assert "data train: fingerprint" in report and "tensors differ" in report and "losses: differ" in report
    assert not same_tensors(run, tmp_path / "after-edit")
