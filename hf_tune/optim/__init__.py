"""Parameter groups (decay / no decay, layer-wise LR decay) for ``HfTuneTrainer.create_optimizer``."""

from __future__ import annotations

from torch import nn

from hf_tune.optim.param_groups import ParamInfo, describe_parameters, find_blocks, group_summary, layerwise_param_groups
from hf_tune.recipe.schema import OptimSection

__all__ = ["ParamInfo", "describe_parameters", "find_blocks", "group_summary", "layerwise_param_groups",
           "recipe_param_infos"]


def recipe_param_infos(model: nn.Module, optim: OptimSection, learning_rate: float, weight_decay: float) -> list[ParamInfo]:
    return describe_parameters(model, learning_rate, weight_decay, layerwise_lr_decay=optim.layerwise_lr_decay,
                               head_lr=optim.head_lr, no_decay=optim.no_decay,
                               loraplus_lr_ratio=optim.loraplus_lr_ratio)
