"""Parameter groups (decay / no decay, layer-wise LR decay) for ``HfTuneTrainer.create_optimizer``.

Light to import: the names below load ``optim.param_groups`` (torch) when first asked for, so ``optim.schedule``
(pure: the recipe's schedule keys) is read by the verbs that never train without importing torch."""

import importlib

__all__ = ["ParamInfo", "describe_parameters", "find_blocks", "group_summary", "layerwise_param_groups",
           "recipe_param_infos"]


def __getattr__(name: str):
    if name in __all__:
        value = getattr(importlib.import_module("hf_tune.optim.param_groups"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'hf_tune.optim' has no attribute {name!r}")
