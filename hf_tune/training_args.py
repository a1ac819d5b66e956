"""``training`` section -> ``transformers.TrainingArguments``, with the defaults a CPU-only machine needs."""

from __future__ import annotations

from transformers import TrainingArguments

from hf_tune.distributed import accelerator_available
from hf_tune.ds_config import init_cpu_deepspeed, load_deepspeed_config
from hf_tune.errors import RecipeError
from hf_tune.optim.schedule import resolve_schedule
from hf_tune.recipe.schema import Recipe
from hf_tune.recipe.upstream import blame_key


def training_kwargs(recipe: Recipe) -> dict:
    """The recipe's ``training`` keys plus what hf_tune fills in when the recipe is silent."""
    kwargs = resolve_schedule(recipe.training, recipe.optim)  # a no-op for a recipe from load_recipe
    if "use_cpu" not in kwargs and not accelerator_available():
        kwargs["use_cpu"] = True  # without it, a CPU run under torchrun trains each rank alone
    if kwargs.get("deepspeed"):  # the JSON itself: the recipe keeps the short name (zero3) or path it was given
        kwargs["deepspeed"] = load_deepspeed_config(kwargs["deepspeed"])
    if recipe.data.batch_tokens and "per_device_train_batch_size" not in kwargs:
        kwargs["per_device_train_batch_size"] = 1  # one pack of up to data.batch_tokens tokens per step and device
    return kwargs


def build_training_arguments(recipe: Recipe) -> TrainingArguments:
    kwargs = training_kwargs(recipe)
    init_cpu_deepspeed(kwargs)
    try:
        return TrainingArguments(**kwargs)
    except (ValueError, TypeError, ImportError) as err:
        raise RecipeError(blame_key("training", recipe.training, str(err)), f"TrainingArguments refused it: {err}") from err
