"""Real 2-process DDP on CPU (gloo) through torchrun and accelerate, and the launches that would silently not be
distributed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import REPO, chat_recipe

BIN = Path(sys.executable).parent


def small_recipe(tmp_path: Path, tiny_llama_dir: str, **training) -> Path:
    raw = chat_recipe(tiny_llama_dir, tmp_path / "run", max_steps=3, **training)
    rows = (REPO / "examples" / "data" / "chat_demo.jsonl").read_text().splitlines()[:24]
    (tmp_path / "train.jsonl").write_text("\n".join(rows) + "\n")
    raw["data"]["train"]["path"] = str(tmp_path / "train.jsonl")
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def run(*command: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / command[0]), *command[1:]], cwd=REPO, capture_output=True, text=True,
                          timeout=600, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})


def assert_data_parallel(run_dir: Path) -> None:
    ranks = [json.loads((run_dir / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world_size"] for r in ranks] == [2, 2] and [r["rank"] for r in ranks] == [0, 1]
    assert ranks[0]["examples"] and not set(ranks[0]["examples"]) & set(ranks[1]["examples"])  # different batches
    assert len(ranks[0]["examples"]) + len(ranks[1]["examples"]) == 24  # together: the whole set, once
    assert ranks[0]["params_sha256"] == ranks[1]["params_sha256"]  # gradients were averaged: one model


@pytest.mark.slow
def test_torchrun_two_processes_train_one_model_on_different_batches(tmp_path, tiny_llama_dir):
    recipe = small_recipe(tmp_path, tiny_llama_dir)
    result = run("torchrun", "--nproc_per_node", "2", "--master_port", "29601", "tests/ddp_probe.py", str(recipe))
    assert result.returncode == 0, result.stderr[-3000:]
    assert_data_parallel(tmp_path / "run")


@pytest.mark.slow
def test_accelerate_multi_gpu_launch_on_cpu_is_data_parallel(tmp_path, tiny_llama_dir):
    recipe = small_recipe(tmp_path, tiny_llama_dir)
    result = run("accelerate", "launch", "--multi_gpu", "--num_processes", "2", "--main_process_port", "29611",
                 "tests/ddp_probe.py", str(recipe))
    assert result.returncode == 0, result.stderr[-3000:]
    assert_data_parallel(tmp_path / "run")


@pytest.mark.slow
def test_accelerate_single_process_launcher_asked_for_two_is_refused(tmp_path, tiny_llama_dir):
    recipe = small_recipe(tmp_path, tiny_llama_dir)
    result = run("accelerate", "launch", "--cpu", "--num_processes", "2", "-m", "hf_tune.run", str(recipe))
    assert result.returncode != 0  # hf_tune exits 2; accelerate reports it as 1
    assert "asked for 2 processes but started only this one" in result.stderr and "--multi_gpu" in result.stderr
    assert not (tmp_path / "run" / "trainer_state.json").exists()


@pytest.mark.slow
def test_torchrun_ranks_that_would_train_alone_are_refused(tmp_path, tiny_llama_dir):
    recipe = small_recipe(tmp_path, tiny_llama_dir, use_cpu=False)  # on CPU: each rank would be world size 1
    result = run("torchrun", "--nproc_per_node", "2", "--master_port", "29621", "-m", "hf_tune.run", str(recipe))
    assert result.returncode != 0
    assert "WORLD_SIZE=2" in result.stderr and "trains alone" in result.stderr
