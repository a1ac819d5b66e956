"""A LoRA run of a tiny model on a GPU with hf_tune's defaults: bf16 where the card has it, the attention decided for
the GPU, a finite and falling loss, and a NaN guard that never syncs the host in the hot path."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import chat_recipe

pytestmark = pytest.mark.gpu


def test_a_bf16_lora_run_trains_on_the_gpu_with_a_falling_loss(tmp_path, tiny_llama_dir):
    from hf_tune import build_run, load_recipe
    from hf_tune.model.attention import loaded_attn_implementation, runs_examples_apart

    raw = chat_recipe(tiny_llama_dir, tmp_path / "run", max_steps=40, learning_rate=3e-3)
    raw["lora"] = {"r": 8, "lora_alpha": 16, "target_modules": "all-linear"}
    trainer = build_run(load_recipe(raw)).trainer
    assert trainer.args.bf16 is torch.cuda.is_bf16_supported() and not trainer.args.use_cpu
    attention = loaded_attn_implementation(trainer.model)
    assert runs_examples_apart(attention), attention  # sdpa_varlen, or flash attention where installed
    trainer.train()
    assert next(trainer.model.parameters()).device.type == "cuda"
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 40 and all(math.isfinite(x) for x in losses)
    assert sum(losses[-5:]) < sum(losses[:5]), losses  # falling: the last five below the first five


def test_the_nan_guard_records_a_loss_without_a_host_sync():
    from hf_tune.trainer.loss_guard import NonFiniteLossGuard

    guard = NonFiniteLossGuard()
    losses = torch.tensor([2.0, float("nan"), 1.0], device="cuda")
    torch.cuda.set_sync_debug_mode("error")  # any synchronising call raises
    try:
        for step in range(3):
            guard.add(losses[step], step + 1)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert int(guard.first_bad_step) == 2 and math.isnan(float(guard.first_bad_loss))
