"""Save on a signal (``training.enable_jit_checkpoint``, on by default): SIGTERM or SIGUSR1 at a step between periodic
saves leaves a complete checkpoint of that step, exit status 75 and a run not marked finished; rerunning the same
command ends bit-identical to a run never stopped, on one process and on 2-process DDP with one rank signalled, and
the trackers continue their run. ZeRO-2: tests/test_deepspeed.py."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import launch
import pytest
import yaml
from conftest import REPO, chat_recipe
from runs import assert_same_run, crash_recipe, step_losses, write

from hf_tune.errors import EXIT_PREEMPTED
from hf_tune.trainer.checkpoints import is_complete

PROBE = "tests/preemption_probe.py"  # hf_tune.run's train, signalling itself at a given step on one rank
TRACKERS_OFFLINE = {**{k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "MLFLOW_"))},
                    "WANDB_MODE": "offline", "WANDB_SILENT": "true"}


def recipe_file(folder: Path, model_dir: str, report_to: str | list = "none", **training) -> Path:
    raw = chat_recipe(model_dir, folder / "run", save_strategy="steps", seed=3, report_to=report_to, **training)
    rows = (REPO / "examples" / "data" / "chat_demo.jsonl").read_text().splitlines()[:24]
    (folder / "train.jsonl").write_text("\n".join(rows) + "\n")  # 6 steps an epoch on 2 ranks: resumes mid-epoch 2
    raw["data"]["train"]["path"] = str(folder / "train.jsonl")
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def run_command(*command: str, threads: bool = False) -> subprocess.CompletedProcess:
    """A launch with the trackers' own variables of this process left out (offline W&B); ``threads``: one CPU
    thread a rank (the 2-rank launches), else the thread count hf_tune decides, as the shared references run."""
    return launch.run(*command, base_env=TRACKERS_OFFLINE, threads=threads)


def torchrun(*args: str) -> list[str]:
    return launch.torchrun(2, *args)


def assert_stopped_unfinished(run_dir: Path, step: int, saved: list[int]) -> None:
    """Stopped at ``step`` with a complete checkpoint of it, and nothing that says the run finished."""
    assert is_complete(run_dir / f"checkpoint-{step}")
    assert sorted(int(p.name.split("-")[1]) for p in run_dir.glob("checkpoint-*")) == saved
    assert not json.loads((run_dir / "run.json").read_text())["end_time"]
    assert not (run_dir / "model.safetensors").exists() and not (run_dir / "train_results.json").exists()
    assert [e["step"] for e in json.loads((run_dir / f"checkpoint-{step}" / "trainer_state.json").read_text())
            ["log_history"] if "loss" in e] == list(range(1, step + 1))  # every step up to the signal, logged


@pytest.mark.slow
def test_sigterm_saves_that_step_exits_75_and_the_rerun_matches_a_run_never_stopped(tmp_path, tiny_llama_dir,
                                                                                    references):
    reference = references.run(crash_recipe(tiny_llama_dir, Path("reference")))  # the crash tests' shared one
    run_dir = tmp_path / "stopped" / "run"
    recipe = write(crash_recipe(tiny_llama_dir, run_dir, report_to=["wandb", "mlflow"]), tmp_path / "stopped.yaml")

    stopped = run_command("python", PROBE, str(recipe), "7", "TERM", "0")  # SIGTERM during step 7; saves: 3, 6, 9
    assert stopped.returncode == EXIT_PREEMPTED, stopped.stderr[-3000:]
    assert "SIGTERM received: saving checkpoint-7 and stopping" in stopped.stderr
    assert_stopped_unfinished(run_dir, 7, saved=[3, 6, 7])
    tracker_ids = [(run_dir / name).read_text() for name in ("wandb_run_id", "mlflow_run_id")]
    from mlflow import MlflowClient

    [(uri, mlflow_id)] = json.loads(tracker_ids[1]).items()
    client = MlflowClient(uri)
    assert client.get_run(mlflow_id).info.status == "KILLED"  # stopped, not failed

    resumed = run_command("python", "-m", "hf_tune.run", str(recipe))  # the same command again
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"Resuming from {run_dir / 'checkpoint-7'}" in resumed.stderr
    assert_same_run(run_dir, reference)  # every loss and the final weights, bit for bit
    assert [(run_dir / name).read_text() for name in ("wandb_run_id", "mlflow_run_id")] == tracker_ids
    wandb_id = tracker_ids[0].strip()
    offline = sorted(p.name for p in (run_dir / "wandb").glob("offline-run-*"))
    assert len(offline) == 2 and all(name.endswith(f"-{wandb_id}") for name in offline)  # one W&B run, resumed
    run = client.get_run(mlflow_id)
    assert run.info.status == "FINISHED" and len(client.search_runs([run.info.experiment_id])) == 1
    logged = {m.step: m.value for m in client.get_metric_history(mlflow_id, "loss")}
    assert logged == pytest.approx(dict(step_losses(run_dir)))  # steps 1-7 before the signal, 8-12 after


@pytest.mark.slow
def test_sigusr1_to_one_ddp_rank_stops_both_at_its_step_and_the_rerun_matches(tmp_path, tiny_llama_dir):
    """Rank 1 alone is signalled; rank 0 learns it at the step's end (an all-reduce), both save and exit 75."""
    (tmp_path / "ref").mkdir(), (tmp_path / "stopped").mkdir()
    settings = {"max_steps": 8, "save_steps": 5}  # 6 steps an epoch: the rerun resumes inside epoch 1, ends in 2
    reference = run_command(*torchrun("-m", "hf_tune.run", str(recipe_file(tmp_path / "ref", tiny_llama_dir,
                                                                           **settings))), threads=True)
    assert reference.returncode == 0, reference.stderr[-3000:]
    recipe = recipe_file(tmp_path / "stopped", tiny_llama_dir, **settings)
    run_dir = tmp_path / "stopped" / "run"

    stopped = run_command(*torchrun(PROBE, str(recipe), "3", "USR1", "1"), threads=True)
    assert stopped.returncode != 0  # torchrun reports its workers' 75 as a failure (exit 1)
    assert [json.loads((run_dir / f"exit-rank{r}.json").read_text())["status"] for r in (0, 1)] == [EXIT_PREEMPTED] * 2
    assert "SIGUSR1 received: saving checkpoint-3" in stopped.stderr
    assert "a signal on another rank received: saving checkpoint-3" in stopped.stderr
    assert_stopped_unfinished(run_dir, 3, saved=[3])

    resumed = run_command(*torchrun("-m", "hf_tune.run", str(recipe)), threads=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Resuming from" in resumed.stderr and "checkpoint-3" in resumed.stderr.split("Resuming from", 1)[1][:300]
    assert_same_run(run_dir, tmp_path / "ref" / "run")


def test_on_by_default_as_hf_tunes_callback_never_upstreams(tmp_path, tiny_llama_dir):
    """Upstream's callback (SIGTERM only, each rank alone, no marker) is never attached; ours unless turned off."""
    from transformers.trainer_jit_checkpoint import JITCheckpointCallback

    from hf_tune import load_recipe
    from hf_tune.assembly.run_build import build_run
    from hf_tune.trainer.preemption import SaveOnSignal
    from hf_tune.workflows.validate import hf_tune_defaults

    for extra, ours in (({}, True), ({"enable_jit_checkpoint": True}, True), ({"enable_jit_checkpoint": False}, False)):
        recipe = load_recipe(chat_recipe(tiny_llama_dir, tmp_path / "run", **extra))
        run = build_run(recipe)
        kinds = {type(c) for c in run.trainer.callback_handler.callbacks}
        assert (SaveOnSignal in kinds) == ours and JITCheckpointCallback not in kinds
        assert run.args.enable_jit_checkpoint is False
        assert hf_tune_defaults(recipe)["training"].get("enable_jit_checkpoint") == (True if not extra else None)
