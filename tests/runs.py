"""Runs the tests share: the one crash recipe, a kill after a checkpoint, the comparisons of a resumed run with an
uninterrupted one, and the session's store of uninterrupted reference runs (``References``, the ``references``
fixture of conftest), so that a reference is trained once per session however many tests compare against it.

A reference is launched as its own process (``python -m hf_tune.run``), as the run it is compared with is: the
two processes start alike, so bit-exact comparisons compare training, not the state of the pytest process."""

from __future__ import annotations

import hashlib
import json
import signal
import subprocess
import time
from pathlib import Path

import launch
import torch
import yaml
from conftest import REPO, chat_recipe
from safetensors.torch import load_file

CRASH_STEPS, CRASH_SAVES = 12, 3  # two complete checkpoints (3, 6) before a kill at 6 still leaves steps to resume


def crash_recipe(model_dir: str, out: Path, **training) -> dict:
    """The crash tests' recipe: 12 steps of 4 chats out of 24 (6 steps an epoch: a resume after step 6 starts in
    epoch 2), a checkpoint every 3, a loss logged every step."""
    settings = {"max_steps": CRASH_STEPS, "save_strategy": "steps", "save_steps": CRASH_SAVES, "logging_steps": 1,
                "seed": 3, "per_device_train_batch_size": 4, **training}
    raw = chat_recipe(model_dir, out, **settings)
    raw["data"]["max_length"] = 96
    raw["data"]["train"]["split"] = "train[:24]"
    return raw


def write(raw: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(raw))
    return path


def step_losses(run_dir: Path) -> list[tuple[int, float]]:
    history = json.loads((run_dir / "trainer_state.json").read_text())["log_history"]
    return [(e["step"], e["loss"]) for e in history if "loss" in e]


def run_to_end(recipe: Path, base_env: dict | None = None) -> subprocess.CompletedProcess:
    return launch.run("python", "-m", "hf_tune.run", str(recipe), base_env=base_env)


def wait_for(predicate, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while not predicate():
        assert proc.poll() is None, f"the run ended before the kill: {proc.stderr.read()[-2000:]}"
        assert time.time() < deadline, "timed out waiting"
        time.sleep(0.02)


def kill_after_checkpoint(recipe: Path, run_dir: Path, step: int, base_env: dict | None = None) -> None:
    from hf_tune.trainer.checkpoints import is_complete

    proc = launch.start("python", "-m", "hf_tune.run", str(recipe), base_env=base_env)
    wait_for(lambda: is_complete(run_dir / f"checkpoint-{step}"), proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def assert_same_run(run: Path, reference: Path, weights: str = "model.safetensors") -> None:
    """Every step's loss and every saved tensor (``weights``: the file), bit for bit."""
    assert step_losses(run) == step_losses(reference)
    mine, theirs = load_file(run / weights), load_file(reference / weights)
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)


def small_recipe(tmp_path: Path, tiny_llama_dir: str, **training) -> Path:
    """A 3-step chat recipe file on the first 24 demo chats (12 a rank on 2 ranks), for the launchers' tests."""
    raw = chat_recipe(tiny_llama_dir, tmp_path / "run", **{"max_steps": 3, **training})
    rows = (REPO / "examples" / "data" / "chat_demo.jsonl").read_text().splitlines()[:24]
    (tmp_path / "train.jsonl").write_text("\n".join(rows) + "\n")
    raw["data"]["train"]["path"] = str(tmp_path / "train.jsonl")
    return write(raw, tmp_path / "recipe.yaml")


def run_ranks(*command: str) -> subprocess.CompletedProcess:
    """A launch of several ranks (torchrun, accelerate, deepspeed) with one CPU thread a rank."""
    return launch.run(*command, threads=True)


def assert_data_parallel(run_dir: Path) -> None:
    """What tests/ddp_probe.py recorded on 2 ranks: different batches, together the 24 examples once, one model."""
    ranks = [json.loads((run_dir / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world_size"] for r in ranks] == [2, 2] and [r["rank"] for r in ranks] == [0, 1]
    assert ranks[0]["examples"] and not set(ranks[0]["examples"]) & set(ranks[1]["examples"])  # different batches
    assert len(ranks[0]["examples"]) + len(ranks[1]["examples"]) == 24  # together: the whole set, once
    assert ranks[0]["params_sha256"] == ranks[1]["params_sha256"]  # gradients were averaged: one model


class References:
    """Uninterrupted runs of a recipe, trained once per session: ``run(raw)`` returns the finished run folder of
    ``raw`` (its ``training.output_dir`` ignored), keyed by the rest of the recipe."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.runs: dict[str, Path] = {}

    def run(self, raw: dict) -> Path:
        keyed = json.loads(json.dumps(raw))
        keyed["training"].pop("output_dir", None)
        key = hashlib.sha256(json.dumps(keyed, sort_keys=True).encode()).hexdigest()[:16]
        if key not in self.runs:
            out = self.folder / key / "run"
            recipe = write({**keyed, "training": {**keyed["training"], "output_dir": str(out)}},
                           self.folder / key / "recipe.yaml")
            result = run_to_end(recipe)
            assert result.returncode == 0, result.stderr[-3000:]
            self.runs[key] = out
        return self.runs[key]


__all__ = ["REPO", "References", "assert_data_parallel", "assert_same_run", "crash_recipe", "kill_after_checkpoint",
           "run_ranks", "run_to_end", "small_recipe", "step_losses", "wait_for", "write"]
