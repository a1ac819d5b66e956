"""Checks of the training section's numbers against each other, made when the recipe loads and naming the key to
change: GRPO's generations against the batch and the world size (TRL divides by them), checkpoint steps against
evaluation steps under ``load_best_model_at_end``. Pure, but for the launcher's ``WORLD_SIZE``."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from hf_tune.catalog.methods import method_of
from hf_tune.errors import RecipeError
from hf_tune.recipe.schema import Recipe


def launch_world_size() -> int:
    """The number of processes of this launch (torchrun, accelerate and deepspeed set ``WORLD_SIZE``), else 1."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def check_training_steps(recipe: Recipe, world_size: int | None = None) -> None:
    """The checks of this module, for a launch of ``world_size`` processes (default: this one's)."""
    world_size = world_size or launch_world_size()
    method = method_of(recipe.method)
    if method.generates and any(f.name == "num_generations" for f in dataclasses.fields(method.config)):
        check_generations(recipe, world_size)
    check_best_model_steps(recipe.training)


def _value(training: dict[str, Any], config: type, key: str) -> Any:
    """The recipe's value of ``key``, else the method config's default."""
    if training.get(key) is not None:
        return training[key]
    field = next((f for f in dataclasses.fields(config) if f.name == key), None)
    return None if field is None or field.default is dataclasses.MISSING else field.default


def check_generations(recipe: Recipe, world_size: int) -> None:
    """GRPO and RLOO sample ``num_generations`` completions per prompt and group their rewards by prompt: a generation
    batch (and an eval batch, across all processes) must hold whole groups (TRL's GRPOConfig divides by them)."""
    training = recipe.training
    config = method_of(recipe.method).config
    value = lambda key: _value(training, config, key)  # noqa: E731
    generations = value("num_generations")
    if generations is None or generations < 2:
        raise RecipeError("training.num_generations", f"is {generations!r}: {method_of(recipe.method).title} "
                          "compares at least 2 completions of each prompt to compute advantages",
                          fix="set training.num_generations to 2 or more (e.g. 4 or 8)")
    per_device = value("per_device_train_batch_size")
    global_batch = per_device * world_size
    launch = f"{per_device} per device x {world_size} process(es)"
    given, steps = value("generation_batch_size"), value("steps_per_generation")
    if given is not None and steps is not None:
        raise RecipeError("training.generation_batch_size", "is set together with training.steps_per_generation",
                          fix="set one of them")
    if given is not None and given % global_batch:
        raise RecipeError("training.generation_batch_size", f"({given}) must be a multiple of the global batch "
                          f"({launch} = {global_batch})", fix=f"e.g. training.generation_batch_size={global_batch}")
    generation_batch = given if given is not None else global_batch * (steps or value("gradient_accumulation_steps"))
    if generation_batch % generations:
        key = "training.generation_batch_size" if given is not None else "training.per_device_train_batch_size"
        raise RecipeError(key, f"a generation batch of {generation_batch} completions ({launch}, times the steps per "
                          f"generation) does not hold whole groups of training.num_generations ({generations})",
                          fix=f"make it a multiple of {generations}: e.g. training.per_device_train_batch_size="
                          f"{-(-per_device // generations) * generations}, or change training.num_generations to a "
                          f"divisor of {generation_batch}")
    if str(training.get("eval_strategy", "no")) != "no":
        eval_generations = value("num_generations_eval") or generations
        eval_batch = value("per_device_eval_batch_size") * world_size
        if eval_batch % eval_generations:
            raise RecipeError("training.per_device_eval_batch_size", f"the eval batch of {eval_batch} completions "
                              f"(x {world_size} process(es)) does not hold whole groups of {eval_generations} "
                              "generations", fix=f"make it a multiple of {eval_generations} (or set "
                              "training.num_generations_eval to a divisor of it)")


def check_best_model_steps(training: dict[str, Any]) -> None:
    """``load_best_model_at_end`` keeps a checkpoint of an evaluated step: saves and evaluations must coincide.
    Named by the keys to change (``save_strategy``, ``save_steps``), not by the flag that asks for it."""
    if not training.get("load_best_model_at_end"):
        return
    evaluate, save = str(training.get("eval_strategy", "no")), str(training.get("save_strategy", "steps"))
    if save == "best":
        return
    if evaluate != save:
        raise RecipeError("training.save_strategy", f"is {save!r} and training.eval_strategy is {evaluate!r}: "
                          "training.load_best_model_at_end keeps the best evaluated checkpoint, so saves and "
                          "evaluations must follow one strategy", fix=f"set training.save_strategy: {evaluate} (or "
                          "'best'), or remove training.load_best_model_at_end")
    if evaluate != "steps":
        return
    save_steps, eval_steps = training.get("save_steps", 500), training.get("eval_steps")
    eval_steps = eval_steps if eval_steps is not None else training.get("logging_steps", 500)
    if _is_multiple(save_steps, eval_steps):
        return
    raise RecipeError("training.save_steps", f"({save_steps}) is not a multiple of training.eval_steps "
                      f"({eval_steps}): training.load_best_model_at_end can only keep a step that was both evaluated "
                      "and saved", fix=f"set training.save_steps to a multiple of {eval_steps} (e.g. "
                      f"{_next_multiple(save_steps, eval_steps)}), or training.eval_steps to a divisor of {save_steps}")


def _is_multiple(save_steps: float, eval_steps: float) -> bool:
    if isinstance(save_steps, float) or isinstance(eval_steps, float):  # fractions of the run: TrainingArguments'
        return round(save_steps * 10**6) % round(eval_steps * 10**6) == 0  # own large-multiplier test
    return save_steps % eval_steps == 0


def _next_multiple(save_steps: float, eval_steps: float) -> float:
    count = max(1, -(-save_steps // eval_steps))
    return round(count * eval_steps, 6) if isinstance(eval_steps, float) else int(count * eval_steps)
