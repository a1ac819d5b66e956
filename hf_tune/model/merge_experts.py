"""A mixture of experts' LoRA in a merge by shard (``hf_tune.model.merge``): PEFT adapts a fused expert tensor
(``target_parameters``; ``[experts, ., .]``) with one ``lora.ParamWrapper`` per tensor, nested on the experts module,
and a checkpoint may store that tensor fused or, where transformers converts it at load, one tensor per expert and
projection. Which wrapper adapts which tensor is read from PEFT itself (the adapter applied to the model's skeleton on
the meta device); how the checkpoint's tensors make up the fused one, from transformers' own conversion mapping."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch


class CannotStreamExperts(Exception):
    """The expert tensors cannot be merged shard by shard (the caller merges through PEFT instead)."""


@dataclass(frozen=True)
class ExpertTarget:
    """One fused expert tensor LoRA adapts: its parameter name, shape and PEFT's layout of the delta."""

    parameter: str  # the model's parameter, e.g. model.layers.0.mlp.experts.gate_up_proj
    shape: tuple[int, ...]  # [experts, ., .]
    swapped: bool  # PEFT's rule: a 3-D tensor is (experts, out, in) unless its module says ``is_transposed``


def expert_targets(skeleton, adapter_config: dict) -> dict[str, ExpertTarget]:
    """{the adapter's module name (PEFT's, ``...experts.base_layer``): the fused tensor it adapts}, by applying the
    adapter's config to ``skeleton`` (a model on the meta device) and reading each ``ParamWrapper``'s
    ``parameter_name``."""
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import ParamWrapper

    fields = set(LoraConfig.__dataclass_fields__)
    config = LoraConfig(**{k: v for k, v in adapter_config.items() if k in fields and k not in (
        "peft_type", "auto_mapping", "base_model_name_or_path", "revision", "task_type", "inference_mode")})
    wrapped = get_peft_model(skeleton, config).base_model.model
    targets = {}
    for name, module in wrapped.named_modules():
        if isinstance(module, ParamWrapper):
            owner = re.sub(r"(\.base_layer)+$", "", name)
            parameter = getattr(wrapped.get_submodule(owner).get_base_layer(), module.parameter_name)
            shape = tuple(parameter.shape)
            is_transposed = getattr(wrapped.get_submodule(owner).get_base_layer(), "is_transposed", False)
            targets[name] = ExpertTarget(f"{owner}.{module.parameter_name}", shape,
                                         swapped=len(shape) == 3 and not is_transposed)
    return targets


def expert_delta(a: torch.Tensor, b: torch.Tensor, scale: float, target: ExpertTarget) -> torch.Tensor:
    """The fused tensor's delta as PEFT's ``ParamWrapper.get_delta_weight`` defines it: ``A`` is
    ``[experts * r, in]``, ``B`` is ``[out, r * experts]`` (rank-major), one ``B_e @ A_e`` per expert."""
    experts = target.shape[0]
    a3 = a.float().reshape(experts, -1, a.shape[-1])  # experts x rank x in
    b3 = b.float().reshape(b.shape[0], -1, experts)  # out x rank x experts
    layout = "o r e, e r i -> e o i" if target.swapped else "o r e, e r i -> e i o"
    return torch.einsum(layout, b3, a3) * scale


def checkpoint_sources(names: set[str], shapes: dict[str, list[int]], model_type: str,
                       fused: set[str]) -> dict[str, tuple[str, int, int, int]]:
    """{checkpoint tensor: (the fused parameter it becomes part of, expert, first row, last row + 1)} for fused
    parameters the checkpoint stores per expert, read from transformers' conversion mapping of ``model_type``
    (renamings, then ``MergeModulelist`` over the experts and ``Concatenate`` along the rows). Fused parameters the
    checkpoint holds as they are need no entry; any other conversion is refused (``CannotStreamExperts``)."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter, WeightRenaming

    wanted = {p for p in fused if p not in names}
    if not wanted:
        return {}
    rules = get_checkpoint_conversion_mapping(model_type) or []
    renamings = [(r.source_patterns[0], r.target_patterns[0]) for r in rules if isinstance(r, WeightRenaming)]
    sources: dict[str, tuple[str, int, int, int]] = {}
    for rule in (r for r in rules if isinstance(r, WeightConverter)):
        kinds = [type(op) for op in rule.operations]
        if kinds not in ([MergeModulelist], [MergeModulelist, Concatenate]) or len(rule.target_patterns) != 1:
            continue
        patterns = [re.compile(re.escape(p).replace(r"\*", r"(\d+)") + "$") for p in rule.source_patterns]
        for key in sorted(names):
            renamed = key
            for old, new in renamings:
                renamed = renamed.replace(old, new)
            for position, pattern in enumerate(patterns):
                match = pattern.search(renamed)
                if match is None:
                    continue
                parameter = renamed[:match.start()] + rule.target_patterns[0]  # the patterns carry their dots
                if parameter in wanted:
                    rows = shapes[key][0]
                    sources[key] = (parameter, int(match.group(1)), position * rows, (position + 1) * rows)
    missing = wanted - {parameter for parameter, *_ in sources.values()}
    if missing:
        raise CannotStreamExperts(f"{sorted(missing)[0]}: not in the base's checkpoint, and transformers' conversion "
                                  f"mapping of {model_type} does not say which of its tensors make it up")
    return sources


__all__ = ["CannotStreamExperts", "ExpertTarget", "checkpoint_sources", "expert_delta", "expert_targets"]
