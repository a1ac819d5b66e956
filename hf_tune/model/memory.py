"""Accelerator memory per rank of a run, from parameter counts and the model's config (the model may sit on the meta
device): model states by setup (DDP, ZeRO-2/3, offload; FSDP full_shard is ZeRO-3's), a quantized base's weights,
and activations per micro-batch. ``plan`` prints them and ``init`` chooses a recipe whose total fits."""

from __future__ import annotations

import math

from torch import nn

from hf_tune.runtime.ds_config import load_deepspeed_config

# CUDA context, cuBLAS / NCCL workspaces and allocator fragmentation: what a rank holds beyond tensors. Measured
# figures on H100 sit between 1 and 3 GiB; the estimate takes the upper end so that a fitting plan fits.
RUNTIME_RESERVE_BYTES = 3 * 2**30
QUANTIZED_BLOCK = 64  # bitsandbytes' 4-bit block size (one absmax per 64 weights)
NESTED_BLOCK = 256  # double quantization: one float32 absmax per 256 block statistics


def model_state_memory(total: int, trainable: int, largest_layer: int, world_size: int, mixed_precision: bool,
                       param_bytes: int) -> dict[str, tuple[float, float]]:
    """(accelerator bytes, CPU bytes) per rank for weights, gradients and AdamW states, by setup.

    DeepSpeed's accounting (its ``estimate_zero{2,3}_model_states_mem_needs`` for a full fine-tune): under mixed
    precision a trained parameter costs a 16-bit weight and gradient plus fp32 gradient, master weight and two Adam
    moments (2 + 2 + 4 + 4 + 8 bytes; ZeRO-3 frees the 16-bit gradient once reduced); in fp32, weight 4 + gradient 4
    + moments 8. ZeRO-2 partitions gradients and optimizer states over the ranks, ZeRO-3 the weights too and gathers
    one layer at a time (``4 x largest_layer``); offload moves what it partitions to CPU (the bundled zero3_offload
    offloads weights as well). Frozen weights (LoRA's base) cost their weight only.
    """
    n = world_size
    weight = 2 if mixed_precision else param_bytes
    partitioned = trainable * (18 if mixed_precision else 12)  # everything per trained parameter but its weight
    partitioned3 = trainable * (16 if mixed_precision else 12)
    gathered = 4 * largest_layer
    ddp = total * param_bytes + trainable * param_bytes * 3  # weights, gradients, two Adam moments in the same dtype
    return {
        "no ZeRO (DDP)": (ddp, 0),
        "ZeRO-2": (total * weight + partitioned / n, 0),
        "ZeRO-2 offload": (total * weight, partitioned / n),
        "ZeRO-3": (gathered + (total * weight + partitioned3) / n, 0),
        "ZeRO-3 offload": (gathered, (total * weight + partitioned3) / n),
    }


def quantized_model_state_memory(weights: int, trainable: int, gathered: int, world_size: int,
                                 mixed_precision: bool) -> dict[str, tuple[float, float]]:
    """The same table for a quantized base (``weights``: its stored bytes, adapters included): only the adapters
    train. ZeRO-3 and FSDP partition the base too, stored in a float dtype (``bnb_4bit_quant_storage``), and gather
    ``gathered`` bytes (the largest layer) at a time."""
    states = trainable * (18 if mixed_precision else 12)  # a trained (adapter) parameter's gradients and AdamW moments
    n = world_size
    return {"no ZeRO (DDP)": (weights + states, 0), "ZeRO-2": (weights + states / n, 0),
            "ZeRO-2 offload": (weights, states / n),
            "ZeRO-3": (gathered + (weights + states) / n, 0), "ZeRO-3 offload": (gathered, (weights + states) / n)}


def model_state_sizes(model: nn.Module) -> tuple[int, int, int]:
    """Parameters (tied ones once), trained parameters, and the most parameters any one module holds itself.
    ``model.parameters()`` yields a shared parameter once, so this holds on the meta device too."""
    params = list(model.parameters())
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    return sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad), largest


def quantized_linear_bytes(numel: int, out_features: int, config: dict) -> int:
    """Bytes bitsandbytes stores for one quantized ``nn.Linear`` weight: 4-bit packs two weights a byte plus one
    float32 absmax per 64 (with double quantization a uint8 per block, a float32 per 256 blocks and its 256-entry
    code) and the 16-entry quantization map; 8-bit keeps one byte a weight plus a float32 scale per output row."""
    if not config.get("load_in_4bit"):
        return numel + 4 * out_features
    blocks = math.ceil(numel / QUANTIZED_BLOCK)
    statistics = blocks + 4 * math.ceil(blocks / NESTED_BLOCK) + 4 * 256 if config.get(
        "bnb_4bit_use_double_quant") else 4 * blocks
    return (numel + 1) // 2 + statistics + 4 * 16


def quantized_weight_memory(model: nn.Module, config: dict) -> dict[str, int]:
    """What ``model.quantization.weight_memory`` measures on a loaded quantized model, computed from a (meta) model
    in its unquantized form: transformers quantizes every ``nn.Linear`` but the output embedding and
    ``llm_int8_skip_modules``; PEFT's adapters stay as they are."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    output = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    skipped = set(config.get("llm_int8_skip_modules") or [])
    quantized: dict[int, int] = {}
    for name, module in base.named_modules():
        if (isinstance(module, nn.Linear) and module is not output and "lora_" not in name
                and not skipped & set(name.split("."))):
            quantized[id(module.weight)] = quantized_linear_bytes(module.weight.numel(), module.out_features, config)
    stored = params = widest = 0
    for param in base.parameters():
        params += param.numel()
        if id(param) in quantized:
            stored += quantized[id(param)]
        else:
            stored += param.numel() * param.element_size()
            if not param.requires_grad:  # the base's width, not float32 adapters'
                widest = max(widest, param.element_size())
    return {"bytes": stored, "params": params, "full_precision_bytes": params * (widest or 4)}


def activation_memory(config, tokens: int, checkpointing: bool, logit_positions: int | None = None,
                      lora_r: int = 0) -> int:
    """Accelerator bytes of the activations one micro-batch of ``tokens`` tokens keeps for backward, in 16-bit.

    Per decoder layer, with an attention that never materialises the score matrix (flash, SDPA, sdpa_varlen): the
    inputs of both norms and the residual, queries, keys, values, the attention output, and the MLP's gate, up,
    activation and product (Korthikanti et al. 2022, eq. 2 without its score terms, for a gated MLP). Activation
    checkpointing keeps each layer's input and recomputes one layer at a time. The LM head adds float32 logits,
    their softmax and gradient (12 bytes a vocabulary entry) for each position whose loss is computed.
    """
    text = getattr(config, "text_config", None) or config
    h, layers = text.hidden_size, text.num_hidden_layers
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or h // heads
    kv = (getattr(text, "num_key_value_heads", None) or heads) * head_dim
    f = getattr(text, "intermediate_size", None) or 4 * h
    per_layer = 2 * tokens * (4 * h + heads * head_dim + 2 * kv + 4 * f + 6 * lora_r)
    kept = layers * 2 * tokens * h + per_layer if checkpointing else layers * per_layer
    positions = tokens if logit_positions is None else logit_positions
    return kept + 12 * positions * text.vocab_size


def recipe_setup(training: dict) -> str:
    """The row of the model-state table a recipe's ``training`` section runs: its DeepSpeed stage and offload, FSDP
    (full_shard partitions as ZeRO-3 does, shard_grad_op as ZeRO-2), or plain DDP."""
    if training.get("deepspeed"):
        zero = load_deepspeed_config(training["deepspeed"]).get("zero_optimization") or {}
        offload = any((zero.get(k) or {}).get("device") in ("cpu", "nvme")
                      for k in ("offload_optimizer", "offload_param"))
        stage = zero.get("stage", 0)
        return f"ZeRO-{stage}" + (" offload" if offload else "") if stage in (2, 3) else "no ZeRO (DDP)"
    fsdp = training.get("fsdp")
    fsdp = " ".join(fsdp) if isinstance(fsdp, list) else str(fsdp or "")
    if "full_shard" in fsdp or "hybrid_shard" in fsdp:
        return "ZeRO-3 offload" if "offload" in fsdp else "ZeRO-3"
    return "ZeRO-2" if "shard_grad_op" in fsdp else "no ZeRO (DDP)"
