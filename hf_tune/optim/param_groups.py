"""Optimizer parameter groups: weight decay / no decay, and layer-wise LR decay (LLRD).

Depth of a parameter: embeddings = 0; transformer block i (0-based) = i + 1; everything else, i.e. after the last
block (final norm, pooler, classifier / LM head) = L + 1, where L is the number of blocks.
Its LR is ``learning_rate * layerwise_lr_decay ** (L + 1 - depth)`` (``head_lr``, when set, replaces it at depth L + 1).
LoRA+ (``loraplus_lr_ratio``): a LoRA B matrix (``lora_B``, ``lora_embedding_B``) gets that LR times the ratio, so
the two rules compose: depth sets the LR of a block's adapters, and B trains ``ratio`` times faster than A.
"""

from __future__ import annotations

import dataclasses
import re

from torch import nn

from hf_tune.errors import HfTuneError
from hf_tune.recipe.schema import OptimSection

# Block lists of the common families, PEFT-wrapped or not: BERT/RoBERTa/DeBERTa `encoder.layer`,
# Llama/Mistral/Qwen/Gemma `model.layers`, GPT-2 `transformer.h`, ViT `vit.layers`, ConvNeXt's stages
# `encoder.stages`; anything else: the longest list of identical blocks. A list inside a block of another list (a
# ConvNeXt stage's layers, an MoE layer's experts) is part of that block, never the blocks themselves.
KNOWN_BLOCK_LISTS = re.compile(r"(^|\.)(encoder\.layer|model\.layers|transformer\.h|layers|blocks|stages)$")


@dataclasses.dataclass(frozen=True)
class ParamInfo:
    name: str
    depth: int
    decay: bool
    lr: float
    weight_decay: float
    numel: int


def find_blocks(model: nn.Module) -> tuple[str, int] | None:
    """(dotted name, length) of the model's list of transformer blocks, or None when it has none."""
    candidates = []
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0 and len({type(m) for m in module}) == 1:
            candidates.append((bool(KNOWN_BLOCK_LISTS.search(name)), len(module), name))
    outer = [c for c in candidates if not any(c[2].startswith(f"{other}.") for _, _, other in candidates)]
    if not outer:
        return None
    _, length, name = max(outer)  # a known name first, then the longest
    return name, length


def is_embedding_param(name: str, module: nn.Module) -> bool:
    return isinstance(module, nn.Embedding) or any("embed" in part or part in ("wte", "wpe")
                                                   for part in name.split(".")[:-1])


def is_norm(module: nn.Module) -> bool:
    return isinstance(module, (nn.LayerNorm, nn.GroupNorm,
                               getattr(nn, "RMSNorm", nn.LayerNorm))) or "Norm" in type(module).__name__


LORA_B = re.compile(r"(^|\.)lora_(embedding_)?B(\.|$)")


def describe_parameters(model: nn.Module, learning_rate: float, weight_decay: float, layerwise_lr_decay: float = 1.0,
                        head_lr: float | None = None, no_decay: list[str] | None = None,
                        loraplus_lr_ratio: float | None = None) -> list[ParamInfo]:
    """Depth, decay, LR and weight decay of every trainable parameter (each tensor once, even when tied)."""
    blocks = find_blocks(model)
    if blocks is None and (layerwise_lr_decay != 1.0 or head_lr is not None):
        raise HfTuneError(f"optim.layerwise_lr_decay: {type(model).__name__} has no list of transformer blocks "
                          "(an nn.ModuleList of identical modules), so layers cannot be told apart\n"
                          "  fix: set optim.layerwise_lr_decay: 1.0 and leave optim.head_lr unset")
    block_list, num_blocks = blocks or ("", 0)
    block_index = re.compile(rf"^{re.escape(block_list)}\.(\d+)\.") if block_list else None
    owners = {f"{mod_name}.{p_name}" if mod_name else p_name: module
              for mod_name, module in model.named_modules() for p_name, _ in module.named_parameters(recurse=False)}
    patterns = [re.compile(p) for p in no_decay] if no_decay is not None else None

    infos, seen = [], set()
    for name, param in model.named_parameters():  # shared (tied) tensors appear once here
        if not param.requires_grad or id(param) in seen:
            continue
        seen.add(id(param))
        module = owners[name]
        match = block_index.match(name) if block_index else None
        if match:
            depth = int(match.group(1)) + 1
        elif is_embedding_param(name, module):
            depth = 0
        else:
            depth = num_blocks + 1
        if patterns is not None:
            decay = not any(p.search(name) for p in patterns)
        else:
            decay = not (name.endswith("bias") or is_norm(module) or is_embedding_param(name, module))
        lr = learning_rate * layerwise_lr_decay ** (num_blocks + 1 - depth)
        if head_lr is not None and depth == num_blocks + 1:
            lr = head_lr
        if loraplus_lr_ratio is not None and LORA_B.search(name):
            lr *= loraplus_lr_ratio
        infos.append(ParamInfo(name, depth, decay, lr, weight_decay if decay else 0.0, param.numel()))
    return infos


def layerwise_param_groups(model: nn.Module, infos: list[ParamInfo]) -> list[dict]:
    """Optimizer groups: parameters with equal (lr, weight_decay) share a group. Each group also records its depths."""
    params = dict(model.named_parameters())
    groups: dict[tuple[float, float], dict] = {}
    for info in infos:
        group = groups.setdefault((info.lr, info.weight_decay),
                                  {"params": [], "lr": info.lr, "weight_decay": info.weight_decay, "depths": []})
        group["params"].append(params[info.name])
        if info.depth not in group["depths"]:
            group["depths"].append(info.depth)
    return sorted(groups.values(), key=lambda g: (min(g["depths"]), g["weight_decay"]))


def group_summary(infos: list[ParamInfo]) -> list[dict]:
    """One row per (depth, decay, LR): what `hf-tune plan` prints (LoRA+ gives a block's B matrices a row of their
    own)."""
    rows: dict[tuple[int, bool, float], dict] = {}
    for info in infos:
        row = rows.setdefault((info.depth, info.decay, info.lr), {"depth": info.depth, "params": 0, "tensors": 0,
                                                         "lr": info.lr, "weight_decay": info.weight_decay})
        row["params"] += info.numel
        row["tensors"] += 1
    return [rows[key] for key in sorted(rows)]


def recipe_param_infos(model: nn.Module, optim: OptimSection, learning_rate: float,
                       weight_decay: float) -> list[ParamInfo]:
    return describe_parameters(model, learning_rate, weight_decay, layerwise_lr_decay=optim.layerwise_lr_decay,
                               head_lr=optim.head_lr, no_decay=optim.no_decay,
                               loraplus_lr_ratio=optim.loraplus_lr_ratio)
