"""``training`` section -> ``transformers.TrainingArguments``, with the defaults a CPU-only machine needs."""

from __future__ import annotations

import dataclasses

from transformers import TrainingArguments

from hf_tune.distributed import accelerator_available
from hf_tune.ds_config import init_cpu_deepspeed, load_deepspeed_config
from hf_tune.errors import RecipeError
from hf_tune.methods import method_of
from hf_tune.optim.schedule import resolve_schedule
from hf_tune.recipe.schema import Recipe
from hf_tune.recipe.upstream import blame_key


def training_kwargs(recipe: Recipe) -> dict:
    """The recipe's ``training`` keys plus what hf_tune fills in when the recipe is silent."""
    kwargs = resolve_schedule(recipe.training, recipe.optim)  # a no-op for a recipe from load_recipe
    tracking = recipe.tracking  # the run's name and project reach every tracker through Trainer's own arguments
    if tracking.name and "run_name" not in kwargs:
        kwargs["run_name"] = tracking.name
    if tracking.project and "project" not in kwargs:  # Trackio's project
        kwargs["project"] = tracking.project
    if "use_cpu" not in kwargs and not accelerator_available():
        kwargs["use_cpu"] = True  # without it, a CPU run under torchrun trains each rank alone
    if kwargs.get("deepspeed"):  # the JSON itself: the recipe keeps the short name (zero3) or path it was given
        kwargs["deepspeed"] = load_deepspeed_config(kwargs["deepspeed"])
    if recipe.data.batch_tokens and "per_device_train_batch_size" not in kwargs:
        kwargs["per_device_train_batch_size"] = 1  # one pack of up to data.batch_tokens tokens per step and device
    if recipe.data.streaming and "accelerator_config" not in kwargs:
        # Each rank reads its share of the stream. accelerate's default for an IterableDataset reads on rank 0 and
        # slices every tensor of a batch along its first dimension, cutting a flattened pack's example boundaries.
        kwargs["accelerator_config"] = {"dispatch_batches": False}
    method = method_of(recipe.method)
    if method.reference and "precompute_ref_log_probs" in _fields(method.config):
        # computed once and cached across runs (hf_tune.reference): the steps then run no reference forward
        kwargs.setdefault("precompute_ref_log_probs", True)
    return kwargs


def _fields(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def build_training_arguments(recipe: Recipe) -> TrainingArguments:
    """The method's config class (``TrainingArguments``, or TRL's ``DPOConfig`` and the like) from the recipe."""
    kwargs = training_kwargs(recipe)
    init_cpu_deepspeed(kwargs)
    try:
        return method_of(recipe.method).config(**kwargs)
    except (ValueError, TypeError, ImportError) as err:
        raise RecipeError(blame_key("training", recipe.training, str(err)), f"TrainingArguments refused it: {err}") from err
