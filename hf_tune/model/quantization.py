"""Quantized bases (bitsandbytes 4-bit and 8-bit): the config from the recipe, preparing a base for QLoRA, the
memory its weights take, and dequantizing it for a merge.

One thing hf_tune changes: on a CPU with AVX512-BF16, bitsandbytes repacks a 4-bit layer's weights into a bfloat16
layout the first time it runs in inference mode (an evaluation), and from then on computes that layer in bfloat16,
training steps included, whatever ``bnb_4bit_compute_dtype`` says; transformers' ``dequantize`` then reads the
repacked weights wrongly (benchmarks/RESULTS.md). ``keep_weight_layout`` turns the
repacking off, so the layer computes in the compute dtype the recipe asked for and stays readable.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from hf_tune.recipe.quantization import quantized_bits

logger = logging.getLogger(__name__)
DTYPE_KEYS = ("bnb_4bit_compute_dtype", "bnb_4bit_quant_storage")


def bitsandbytes_config(config: dict[str, Any]):
    """``BitsAndBytesConfig`` from the recipe's ``model.quantization_config`` (dtype names become torch dtypes)."""
    from transformers import BitsAndBytesConfig

    kwargs = {k: v for k, v in config.items() if not k.startswith("_") and k != "quant_method"}
    for key in DTYPE_KEYS:
        if isinstance(kwargs.get(key), str):
            kwargs[key] = getattr(torch, kwargs[key].removeprefix("torch."))
    return BitsAndBytesConfig(**kwargs)


def keep_weight_layout(model) -> int:
    """Stop bitsandbytes from repacking 4-bit CPU weights to bfloat16 at the first evaluation (see the module
    docstring); returns how many layers it applies to."""
    layers = 0
    for module in model.modules():
        if getattr(module, "support_avx512bf16_for_cpu", False):
            module.support_avx512bf16_for_cpu = False
            layers += 1
    return layers


def stored_for_sharding(model) -> bool:
    """The 4-bit weights are stored in a float dtype (``bnb_4bit_quant_storage``, as ZeRO-3 and FSDP QLoRA need) and
    the run is distributed (ZeRO-3 set up, or several processes): the base is to be sharded in that one dtype."""
    import os

    from transformers.integrations import is_deepspeed_zero3_enabled

    stored = any(type(p).__name__ == "Params4bit" and p.dtype.is_floating_point for p in model.parameters())
    return stored and (is_deepspeed_zero3_enabled() or int(os.environ.get("WORLD_SIZE", "1")) > 1)


def prepare_for_lora(model, gradient_checkpointing: bool, gradient_checkpointing_kwargs: dict | None = None):
    """PEFT's ``prepare_model_for_kbit_training``: the base frozen, its non-quantized 16-bit parameters (norms,
    embeddings) cast to float32, inputs that require grad. Gradient checkpointing follows
    ``training.gradient_checkpointing`` (upstream's helper turns it on by default). A base stored for sharding keeps
    its one dtype (no float32 cast: ZeRO-3 and FSDP flatten parameters of one dtype), as TRL does for sharded QLoRA;
    a single process casts as before."""
    from peft import prepare_model_for_kbit_training

    keep_weight_layout(model)
    if not stored_for_sharding(model):
        return prepare_model_for_kbit_training(model, use_gradient_checkpointing=gradient_checkpointing,
                                               gradient_checkpointing_kwargs=gradient_checkpointing_kwargs)
    model.requires_grad_(False)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=gradient_checkpointing_kwargs)
        model.enable_input_require_grads()  # frozen embeddings: checkpointed blocks need an input that requires grad
    return model


def describe(config: dict[str, Any]) -> str:
    """``4-bit nf4, double quantization, compute float32`` or ``8-bit``: for logs and ``plan``."""
    bits = quantized_bits(config)
    if bits == 8:
        return "8-bit (LLM.int8)"
    parts = [f"4-bit {config.get('bnb_4bit_quant_type', 'fp4')}"]
    if config.get("bnb_4bit_use_double_quant"):
        parts.append("double quantization")
    parts.append(f"compute {str(config.get('bnb_4bit_compute_dtype') or 'float32').removeprefix('torch.')}")
    return ", ".join(parts)


def weight_memory(model) -> dict[str, int]:
    """Bytes the base's weights take as loaded, and their parameter count: a 4-bit weight counts its packed bytes
    plus its quantization statistics (block absmax, and with double quantization their own codes), an 8-bit one its
    int8 bytes and row scales. ``full_precision_bytes``: the same parameters at the width of the unquantized ones."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    stored = params = 0
    widest = 0
    seen = set()
    for module in base.modules():
        for name, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            state = getattr(param, "quant_state", None)
            if state is not None:  # bitsandbytes Params4bit
                params += int(torch.Size(state.shape).numel())
                stored += param.numel() * param.element_size() + _quant_state_bytes(state)
            elif type(param).__name__ == "Int8Params":
                params += param.numel()
                scales = getattr(param, "SCB", None)
                stored += param.numel() + (scales.numel() * scales.element_size() if scales is not None else 0)
            else:
                params += param.numel()
                stored += param.numel() * param.element_size()
                widest = max(widest, param.element_size())
    return {"bytes": stored, "params": params, "full_precision_bytes": params * (widest or 4)}


def _quant_state_bytes(state) -> int:
    total = 0
    for tensor in (state.absmax, state.code):
        total += tensor.numel() * tensor.element_size() if tensor is not None else 0
    nested = getattr(state, "state2", None)
    if nested is not None:
        total += _quant_state_bytes(nested)
    return total


def dequantize(model, dtype: torch.dtype):
    """The base model with every bitsandbytes layer replaced by an ``nn.Linear`` of ``dtype`` holding the
    dequantized weights (transformers' ``dequantize``), so that a LoRA adapter merges into plain weights."""
    keep_weight_layout(model)
    return model.dequantize(dtype=dtype)
