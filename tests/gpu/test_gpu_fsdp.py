"""FSDP2 + LoRA through ``accelerate launch`` with the shipped examples/launch/fsdp2.yaml, on the GPUs at hand (one
is enough): the final save holds the whole adapter, every LoRA tensor equal to the live one, and a resume from the
checkpoint (sharded, as the config says) loads all of it back (accelerate#4206 saved a fraction of it under FSDP2)."""

from __future__ import annotations

import subprocess

import launch
import pytest
import torch
import yaml
from conftest import REPO, chat_recipe, free_port

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
PROBE = REPO / "tests" / "gpu" / "fsdp_probe.py"


def fsdp_launch(recipe_path) -> subprocess.CompletedProcess:
    return launch.run("accelerate", "launch", "--config_file", str(REPO / "examples" / "launch" / "fsdp2.yaml"),
                      "--num_processes", str(torch.cuda.device_count()), "--main_process_port", str(free_port()),
                      str(PROBE), str(recipe_path), timeout=900)


def adapter_file(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    path = folder / "adapter_model.safetensors"
    assert path.is_file(), sorted(p.name for p in folder.iterdir())
    return {name: value.float() for name, value in load_file(path).items()}


def assert_same_adapter(saved: dict, live: dict) -> None:
    assert live and saved.keys() == live.keys(), (len(saved), len(live), sorted(set(live) ^ set(saved))[:6])
    for name, value in live.items():
        assert saved[name].shape == value.shape and torch.allclose(saved[name], value, atol=1e-6, rtol=0), name


def test_fsdp2_lora_saves_and_resumes_the_whole_adapter(tmp_path, tiny_llama_dir):
    out = tmp_path / "run"
    raw = chat_recipe(tiny_llama_dir, out, max_steps=3, save_strategy="steps", save_steps=3)
    raw["lora"] = {"r": 8, "lora_alpha": 16, "target_modules": "all-linear", "lora_dropout": 0.0}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw))
    first = fsdp_launch(path)
    assert first.returncode == 0, first.stderr[-4000:]
    live = torch.load(out / "live-end.pt")
    assert len(live) == 2 * 7 * 2  # A and B of q, k, v, o, gate, up, down in both blocks
    assert all(value.abs().sum() > 0 for name, value in live.items() if "lora_B" in name)  # trained off zero
    assert_same_adapter(adapter_file(out), live)  # the final save (fsdp2.yaml: SHARDED_STATE_DICT checkpoints)
    assert (out / "checkpoint-3").is_dir()

    raw["training"]["max_steps"] = 5  # resumes from checkpoint-3
    path.write_text(yaml.safe_dump(raw))
    (out / "live-begin.pt").unlink()
    second = fsdp_launch(path)
    assert second.returncode == 0, second.stderr[-4000:]
    assert_same_adapter(torch.load(out / "live-begin.pt"), live)  # the resume loaded every tensor back
    resumed_end = torch.load(out / "live-end.pt")
    assert_same_adapter(adapter_file(out), resumed_end)
    assert any(not torch.equal(resumed_end[n], live[n]) for n in live)  # steps 4 and 5 trained on
