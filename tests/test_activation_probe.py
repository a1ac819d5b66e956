"""The activation probe (hf_tune/model/activation_probe.py): its figure, measured on narrow 1- and 2-layer copies and
scaled, agrees within 10 % with what a real training step of the full shape keeps for backward, counted here by
another instrument: autograd's saved-tensor hooks through the trainer's own ``compute_loss``."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    TrainingArguments,
)

from hf_tune.assembly.run_build import causal_loss
from hf_tune.model.activation_probe import ProbeSetup, estimate_activations, probe_lengths, width_fit
from hf_tune.model.loss import is_chunked
from hf_tune.model.moe import moe_lora
from hf_tune.recipe import validate_recipe
from hf_tune.trainer.hooks import HfTuneTrainer
from hf_tune.trainer.monitors import Monitors

LENGTHS = [600, 200, 224]  # one pack: padded to its longest, 1.76x its tokens (sdpa_varlen pads so)
SHAPE = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, vocab_size=4096)
FAMILIES = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM),  # qwen3: q/k norms
            # a mixture of experts: 8 fused experts, 2 a token; all-linear LoRA adapts them (PEFT's ParamWrapper)
            "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM)}
MOE_SHAPE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256)


def saved_for_backward(trainer, model, batch, checkpointing: bool) -> int:
    """Bytes autograd keeps after the trainer's training forward: every tensor packed by a saved-tensor hook, each
    storage once, the model's weights excluded; under activation checkpointing each decoder layer's tensor inputs (what
    the checkpoint keeps to recompute it) are added, as a forward pre-hook sees them."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def count(tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            seen[storage.data_ptr()] = storage.nbytes()

    def count_inputs(module, args, kwargs) -> None:
        for value in (*args, *kwargs.values(), *(kwargs.get("position_embeddings") or ())):
            if torch.is_tensor(value):
                count(value)

    def pack(tensor):
        count(tensor)
        return tensor

    handles = []
    if checkpointing:
        for layer in model.get_decoder().layers:
            handles.append(layer.register_forward_pre_hook(count_inputs, with_kwargs=True))
    model = trainer.accelerator.prepare_model(model)  # with mixed precision: its forward under autocast
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), trainer.compute_loss_context_manager():
        loss = trainer.compute_loss(model, dict(batch))  # as Trainer.training_step calls it
    for handle in handles:
        handle.remove()
    del loss
    return sum(seen.values())


def full_step_bytes(family: str, dtype, dropout: float | None, checkpointing: bool, chunked: bool,
                    tmp_path) -> tuple[int, ProbeSetup]:
    config_class, model_class = FAMILIES[family]
    config = config_class(**SHAPE, **(MOE_SHAPE if family == "qwen3_moe" else {}))
    mixed = dtype == torch.bfloat16
    data = tmp_path / "train.jsonl"
    data.write_text('{"text": "a"}\n')
    lora = None if dropout is None else {"r": 16, "lora_alpha": 32, "lora_dropout": dropout,
                                         "target_modules": "all-linear"}
    recipe = validate_recipe({"model": {"pretrained_model_name_or_path": "x", "chunked_loss": chunked},
                              "data": {"train": {"path": str(data)}}, **({"lora": lora} if lora else {})})
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        torch.manual_seed(0)
        model = model_class(config)
    finally:
        torch.set_default_dtype(previous)
    model.set_attn_implementation("sdpa_varlen")
    if lora:
        if checkpointing:
            model.enable_input_require_grads()
        model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **moe_lora(model, lora)))
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, bf16=mixed, report_to=[])
    trainer = HfTuneTrainer(model=model, args=args, compute_loss_func=causal_loss(recipe, model), causal=True,
                            monitors=Monitors())  # the loss alone: nothing fed
    starts = torch.tensor([0, 600, 800, 1024], dtype=torch.int32)
    ids = torch.randint(0, config.vocab_size, (1, sum(LENGTHS)), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids.clone(),
             "position_ids": torch.cat([torch.arange(n) for n in LENGTHS]).unsqueeze(0),
             "cu_seq_lens_q": starts, "cu_seq_lens_k": starts, "max_length_q": 600, "max_length_k": 600}
    runs_chunked = is_chunked(trainer.compute_loss_func)  # a mixture of experts' adds its router's loss to it
    assert runs_chunked == chunked  # the recipe's loss, decided on the model as a run decides it
    setup = ProbeSetup(model_class, config, dtype, mixed, "sdpa_varlen", True, lora, False, chunked, checkpointing)
    return saved_for_backward(trainer, model, batch, checkpointing), setup


@pytest.mark.parametrize("family,dtype,dropout,checkpointing,chunked", [
    ("llama", torch.float32, 0.05, False, True),
    ("llama", torch.bfloat16, 0.0, False, False),
    ("llama", torch.bfloat16, 0.05, True, True),
    ("qwen3", torch.bfloat16, 0.05, False, True),
    ("qwen3", torch.float32, 0.0, True, False),
    ("llama", torch.float32, None, False, False),  # a full fine-tune
    ("qwen3_moe", torch.bfloat16, 0.0, False, True),  # LoRA on the experts' fused tensors too
])
def test_probe_agrees_with_a_full_training_step(family, dtype, dropout, checkpointing, chunked, tmp_path):
    measured, setup = full_step_bytes(family, dtype, dropout, checkpointing, chunked, tmp_path)
    estimate = estimate_activations(setup, sum(LENGTHS), padding_ratio=3 * 600 / sum(LENGTHS))
    assert estimate.source == "probe"
    assert abs(estimate.kept - measured) <= 0.10 * measured, (estimate.kept, measured)
    assert estimate.peak >= estimate.kept


def test_width_fit_recovers_a_quadratic_in_one_over_k():
    a, b, c = 7.0, 300.0, 4000.0
    points = [(k, a + b / k + c / k ** 2) for k in (16, 8, 4)]
    assert width_fit(points) == pytest.approx(a + b + c)


@pytest.mark.parametrize("ratio", [1.0, 1.76, 5.3])
def test_probe_pack_keeps_the_datas_longest_to_mean_ratio(ratio):
    lengths = probe_lengths(512, ratio)
    assert sum(lengths) == 512
    assert max(lengths) / (512 / len(lengths)) == pytest.approx(ratio, rel=0.05)
