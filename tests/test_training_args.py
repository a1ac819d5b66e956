"""``training`` -> TrainingArguments defaults that depend on the machine (hf_tune/training_args.py)."""

from __future__ import annotations

import pytest
from conftest import DATA, chat_recipe

GPU_ADDS = {"bf16": True, "logging_nan_inf_filter": False}


@pytest.mark.parametrize("training, bf16_supported, launcher, added", [
    ({}, True, None, GPU_ADDS),
    ({}, False, None, {"logging_nan_inf_filter": False}),                     # a T4 or V100: float32 stays
    ({"bf16": False}, True, None, {"logging_nan_inf_filter": False}),         # the recipe said so
    ({"fp16": True}, True, None, {"logging_nan_inf_filter": False}),
    ({"logging_nan_inf_filter": True}, True, None, {"bf16": True}),
    ({}, True, "fp16", {"logging_nan_inf_filter": False}),                    # accelerate launch's mixed precision
    ({}, True, "bf16", GPU_ADDS),
    ({"deepspeed": {"fp16": {"enabled": True}}}, True, None, {"logging_nan_inf_filter": False}),
    ({"deepspeed": {"bf16": {"enabled": "auto"}}}, True, None, GPU_ADDS),     # "auto" follows training.bf16
])
def test_a_cuda_run_gets_bf16_only_where_nothing_set_the_precision(training, bf16_supported, launcher, added):
    from hf_tune.training_args import gpu_defaults

    assert gpu_defaults(training, True, bf16_supported, launcher) == added


def test_nothing_changes_without_cuda():
    from hf_tune.training_args import gpu_defaults

    assert gpu_defaults({}, False, False) == {}


def test_on_this_machine_the_arguments_follow_its_device(tmp_path, tiny_llama_dir):
    import torch

    from hf_tune import load_recipe
    from hf_tune.training_args import build_training_arguments

    args = build_training_arguments(load_recipe(chat_recipe(tiny_llama_dir, tmp_path / "run")))
    cuda_bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    assert args.bf16 is cuda_bf16 and args.logging_nan_inf_filter is not torch.cuda.is_available()


@pytest.mark.parametrize("method, training, checkpointing", [
    ("dpo", {}, True),                                      # TRL's default, stated
    ("kto", {}, True),
    ("dpo", {"activation_checkpointing": False}, False),   # the recipe said so
    ("dpo", {"gradient_checkpointing": False}, False),     # transformers' older name says so too
    ("dpo", {"precompute_ref_log_probs": False}, True),
])
def test_dpo_and_kto_keep_trls_activation_checkpointing_unless_the_recipe_turns_it_off(
        tmp_path, tiny_llama_dir, method, training, checkpointing):
    from hf_tune import load_recipe
    from hf_tune.training_args import build_training_arguments, training_kwargs

    raw = chat_recipe(tiny_llama_dir, tmp_path / "run", **training)
    raw.update(method=method, data={"format": "preference", "train": {"path": str(DATA / "preference_demo.jsonl")}})
    recipe = load_recipe(raw)
    args = build_training_arguments(recipe)
    assert args.activation_checkpointing is checkpointing and args.gradient_checkpointing is checkpointing
    assert args.precompute_ref_log_probs is training.get("precompute_ref_log_probs", True)
    if not training:
        assert training_kwargs(recipe)["activation_checkpointing"] is True  # what `hf-tune effective` lists


def test_sft_keeps_trainers_default_without_checkpointing(tmp_path, tiny_llama_dir):
    from hf_tune import load_recipe
    from hf_tune.training_args import build_training_arguments, training_kwargs

    recipe = load_recipe(chat_recipe(tiny_llama_dir, tmp_path / "run"))
    assert "activation_checkpointing" not in training_kwargs(recipe)
    assert build_training_arguments(recipe).activation_checkpointing is False
