"""``training`` section -> ``transformers.TrainingArguments``, with the defaults a CPU-only machine needs."""

from __future__ import annotations

import torch
from transformers import TrainingArguments

from hf_tune.errors import RecipeError
from hf_tune.recipe.loading import Recipe
from hf_tune.recipe.upstream import blame_key


def accelerator_available() -> bool:
    return bool(torch.accelerator.is_available()) if hasattr(torch, "accelerator") else torch.cuda.is_available()


def training_kwargs(recipe: Recipe) -> dict:
    """The recipe's ``training`` keys plus what hf_tune fills in when the recipe is silent."""
    kwargs = dict(recipe.training)
    if "use_cpu" not in kwargs and not accelerator_available():
        kwargs["use_cpu"] = True  # without it, a CPU run under torchrun trains each rank alone
    return kwargs


def build_training_arguments(recipe: Recipe) -> TrainingArguments:
    kwargs = training_kwargs(recipe)
    try:
        return TrainingArguments(**kwargs)
    except (ValueError, TypeError, ImportError) as err:
        raise RecipeError(blame_key("training", recipe.training, str(err)), f"TrainingArguments refused it: {err}") from None
