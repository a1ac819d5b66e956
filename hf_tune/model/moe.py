"""Mixture-of-experts models as one shape read from the model itself (real or on the meta device): how many experts,
how many run per token, where the fused expert tensors live, and what that makes of the parameter counts (every
expert's weights are held in memory; only the active ones cost compute). The LoRA targets hf_tune resolves for such a
model live here too: ``all-linear`` adapts attention and the experts (PEFT's ``target_parameters``), never the router.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import nn

from hf_tune.errors import RecipeError

# config attributes naming the routed experts and the experts a token runs through, as transformers' MoE configs do
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
EXPERTS_PER_TOKEN_KEYS = ("num_experts_per_tok", "num_experts_per_token", "moe_topk")


@dataclass(frozen=True)
class MoeShape:
    """A mixture of experts, as the model holds it."""

    experts: int  # routed experts per MoE layer
    experts_per_token: int
    moe_layers: int  # layers whose MLP is routed
    expert_weights: tuple[str, ...]  # leaf names of those tensors that LoRA can adapt (3-D weights, no biases)
    router_modules: tuple[str, ...]  # leaf names of the routers (the gate that scores the experts)
    total_parameters: int
    routed_parameters: int  # parameters of the routed experts (weights and biases), all layers
    router_parameters: int  # the routers' weights, all layers (every token runs them)

    @property
    def active_routed_parameters(self) -> int:
        """The routed experts' parameters one token runs through (its experts per token, in every MoE layer)."""
        return round(self.routed_parameters * self.experts_per_token / self.experts)

    @property
    def active_parameters(self) -> int:
        """Parameters one token runs through: everything but the routed experts it is not sent to."""
        return self.total_parameters - self.routed_parameters + self.active_routed_parameters

    def describe(self) -> str:
        return (f"mixture of experts: {self.experts} experts, {self.experts_per_token} per token, in "
                f"{self.moe_layers} layers; {self.total_parameters / 1e9:.2f}B parameters held, "
                f"{self.active_parameters / 1e9:.2f}B active per token")


def _first(config, keys: tuple[str, ...]) -> int | None:
    for key in keys:
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def is_moe_config(config) -> bool:
    """Whether a model config routes tokens among experts (its expert count and experts per token are set)."""
    config = getattr(config, "text_config", None) or config
    return bool(_first(config, EXPERT_COUNT_KEYS) and _first(config, EXPERTS_PER_TOKEN_KEYS))


def moe_shape(model: nn.Module) -> MoeShape | None:
    """The model's mixture-of-experts shape, or None for a dense model. Expert tensors are found as the parameters
    whose first dimension is the expert count, held by a module named ``experts`` (transformers 5 fuses every expert
    of a layer into one 3-D tensor per projection); routers are modules named ``gate`` or ``router`` holding an
    ``[experts, hidden]`` weight. A model wrapped by PEFT is read through its wrappers."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    config = getattr(config, "text_config", None) or config
    experts, per_token = _first(config, EXPERT_COUNT_KEYS), _first(config, EXPERTS_PER_TOKEN_KEYS)
    if not experts or not per_token:
        return None
    modules, weights, routers, routed, router_params = set(), set(), set(), 0, 0
    for name, param in base.named_parameters():
        if "lora_" in name:
            continue
        *path, owner, leaf = name.replace(".base_layer", "").split(".")  # PEFT's wrappers stripped
        shape = tuple(getattr(param, "ds_shape", param.shape))  # ZeRO-3 leaves an empty local shard
        if owner == "experts" and len(shape) >= 2 and shape[0] == experts:
            modules.add(".".join([*path, owner]))
            weights.update([leaf] if len(shape) == 3 else [])
            routed += math.prod(shape)
        elif owner in ("gate", "router") and leaf == "weight" and shape[:1] == (experts,):
            routers.add(owner)
            router_params += math.prod(shape)
    if not modules:
        return None
    total = sum(math.prod(getattr(p, "ds_shape", p.shape)) for name, p in base.named_parameters()
                if "lora_" not in name)  # the model's own parameters, adapters aside
    return MoeShape(experts=experts, experts_per_token=per_token, moe_layers=len(modules),
                    expert_weights=tuple(sorted(weights)), router_modules=tuple(sorted(routers)),
                    total_parameters=total, routed_parameters=routed, router_parameters=router_params)


def _linear_leaf_names(model: nn.Module, exclude: set[str]) -> list[str]:
    from transformers.pytorch_utils import Conv1D

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    return sorted({name.rsplit(".", 1)[-1] for name, module in base.named_modules()
                   if isinstance(module, (nn.Linear, Conv1D)) and module is not head} - exclude)


def attention_only_targets(model: nn.Module, shape: MoeShape) -> list[str]:
    """The linear layers outside the experts and the routers: attention (and any dense MLP), the experts frozen."""
    return _linear_leaf_names(model, set(shape.router_modules))


def fused_expert_targets(shape: MoeShape) -> list[str]:
    """PEFT ``target_parameters`` naming the fused expert weights (``experts.gate_up_proj``, ...)."""
    return [f"experts.{name}" for name in shape.expert_weights]


def moe_lora(model: nn.Module, lora: dict) -> dict:
    """The ``lora`` section as hf_tune hands it to PEFT for a mixture of experts: ``all-linear`` resolves to the
    linear layers outside the experts and routers, plus the fused expert weights as ``target_parameters`` (PEFT's
    own resolution adapts the router too). Experts adapted with dropout is refused with both ways out: PEFT's
    ``ParamWrapper`` (LoRA on a fused tensor) cannot apply dropout to its input. A dense model's section is kept."""
    shape = moe_shape(model)
    if shape is None:
        return lora
    lora = dict(lora)
    if lora.get("target_modules") == "all-linear":
        lora["target_modules"] = attention_only_targets(model, shape)
        lora.setdefault("target_parameters", fused_expert_targets(shape))
    adapted = [name for name in lora.get("target_parameters") or []
               if name.rsplit(".", 1)[-1] in shape.expert_weights]
    if adapted and lora.get("lora_dropout"):
        attention = attention_only_targets(model, shape)
        raise RecipeError(
            "lora.lora_dropout", f"{lora['lora_dropout']} with LoRA on this mixture of experts' fused expert tensors "
            f"({', '.join(adapted)}, as target_parameters or through all-linear): PEFT adapts a fused tensor only "
            "without dropout (lora.ParamWrapper)",
            fix=f"lora.lora_dropout: 0 to adapt the experts too, or lora.target_modules: [{', '.join(attention)}] "
                "to adapt attention only with the experts frozen (dropout allowed)")
    return lora


__all__ = ["MoeShape", "attention_only_targets", "fused_expert_targets", "is_moe_config", "moe_lora", "moe_shape"]
