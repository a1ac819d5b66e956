"""The resolved recipe: what ``recipe.yaml``, ``run.json`` and ``hf-tune validate`` show, a recipe as plain data with
the keys hf_tune decides made explicit (the LR schedule)."""

from __future__ import annotations

from typing import Any

from hf_tune.optim.schedule import resolve_schedule
from hf_tune.recipe.schema import Recipe


def resolved_recipe_dict(recipe: Recipe) -> dict[str, Any]:
    """The recipe as plain data with its schedule made explicit (secrets not yet redacted). The ``Recipe`` itself
    keeps the keys as written, so a search trial that changes optim.min_lr_ratio or training.lr_scheduler_type
    resolves its own schedule."""
    resolved = recipe.to_dict()
    resolved["training"] = resolve_schedule(recipe.training, recipe.optim)
    return resolved
