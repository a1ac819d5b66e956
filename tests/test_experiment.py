"""The experiment example (examples/experiment/) end to end at a small size: a 2-trial search on the tiny Llama scored
on the held-out persona task, the best configuration killed after its first checkpoint and resumed, reproduced bit
for bit from its folder, scored before and after, planned, and pushed to the stand-in Hub (the network boundary)."""

from __future__ import annotations

import importlib.util
import json

import pytest
from conftest import REPO
from fake_hub import FakeHub
from inputs import TOKEN
from safetensors.torch import load_file

pytestmark = pytest.mark.slow


def experiment_script():
    spec = importlib.util.spec_from_file_location("experiment", REPO / "examples" / "experiment" / "experiment.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_experiment_searches_kills_resumes_reproduces_and_pushes(tmp_path, tiny_llama_dir, monkeypatch, capsys):
    import launch
    from huggingface_hub import constants

    monkeypatch.chdir(REPO)  # the recipe names its data relative to the checkout, as a user runs it
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    out = tmp_path / "experiment"
    small = ["--set", f"model.pretrained_model_name_or_path={tiny_llama_dir}", "--set", "training.max_steps=4",
             "--set", "training.eval_steps=2", "--set", "evaluation.limit=8", "--set", "evaluation.sample_max_new_tokens=4",
             "--set", "data.eval_split=0.05", "--trials", "2", "--save-steps", "2"]
    with FakeHub() as hub:
        monkeypatch.setattr(constants, "ENDPOINT", hub.url)
        launch.COUNTS["launches python"] += 2  # the script's two launches of the best run (a kill, then a resume)
        launch.COUNTS["launches"] += 2
        launch.COUNTS["interpreter starts"] += 2
        report = experiment_script().main(["--out", str(out), *small, "--push", "alice/experiment",
                                           "--push-merged"]).read_text()

    study = json.loads((out / "search" / "study.json").read_text())
    assert len(study["trials"]) == 2 and (out / "search" / "best_recipe.yaml").is_file()
    assert "| trial | state | learning_rate | lora.r | persona score |" in report

    best = out / "best"
    assert "Killed with SIGKILL after checkpoint-2" in report
    resumed_log = (out / "best-resumed.log").read_text()
    assert "checkpoint-2" in resumed_log  # the rerun resumed from the checkpoint the kill left
    state = json.loads((best / "trainer_state.json").read_text())
    assert state["global_step"] == 4 and json.loads((best / "run.json").read_text())["end_time"]

    a, b = load_file(best / "adapter_model.safetensors"), load_file(out / "best-reproduced" / "adapter_model.safetensors")
    assert set(a) == set(b) and all(a[k].equal(b[k]) for k in a)  # killed + resumed == never killed, bit for bit
    assert "reproduced: yes" in report

    evaluations = [row for row in state["log_history"] if "eval_loss" in row]
    assert evaluations[0]["step"] == 0 and evaluations[-1]["step"] == 4
    assert f"| {evaluations[0]['eval_hf_tune_persona_acc']} | {evaluations[-1]['eval_hf_tune_persona_acc']} |" in report
    assert "## Memory and scaling" in report and "| ZeRO-3 |" in report

    assert len(hub.commits) == 1 and hub.commits[0]["repo"] == "alice/experiment"
    assert "model.safetensors" in hub.commits[0]["files"] and "## Pushed" in report
