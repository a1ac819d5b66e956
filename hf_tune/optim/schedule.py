"""The LR schedule: linear warmup, then cosine down to ``optim.min_lr_ratio`` x each group's own peak LR.

That is upstream's ``cosine_with_min_lr`` with ``min_lr_rate``: a ratio, so each LLRD group keeps its own floor, and
Trainer steps it per optimizer step (exact under accumulation and resume). Any other ``lr_scheduler_type`` is
passed through untouched.
"""

from __future__ import annotations

from typing import Any

from hf_tune.errors import RecipeError
from hf_tune.recipe.schema import OptimSection

COSINE_SCHEDULES = ("cosine", "cosine_with_min_lr")


def resolve_schedule(training: dict[str, Any], optim: OptimSection) -> dict[str, Any]:
    """A copy of the ``training`` section with the schedule made explicit (what the resolved recipe shows)."""
    ratio = optim.min_lr_ratio
    kind = str(training.get("lr_scheduler_type", "cosine_with_min_lr"))
    if kind not in COSINE_SCHEDULES:
        if ratio:
            raise RecipeError("optim.min_lr_ratio", f"is a floor for the cosine schedule, but "
                              f"training.lr_scheduler_type is {kind!r}", fix="remove optim.min_lr_ratio, or use cosine")
        resolved = dict(training)
        kwargs = dict(training.get("lr_scheduler_kwargs") or {})
        if "min_lr_rate" in kwargs:  # only cosine_with_min_lr takes it (a search trial switching from the default)
            kwargs.pop("min_lr_rate")
            resolved["lr_scheduler_kwargs"] = kwargs
        return resolved
    kwargs = dict(training.get("lr_scheduler_kwargs") or {})
    if "min_lr" in kwargs or ("min_lr_rate" in kwargs and kwargs["min_lr_rate"] != ratio and ratio):
        raise RecipeError("training.lr_scheduler_kwargs", "sets the floor of the schedule; so does optim.min_lr_ratio",
                          fix="set only optim.min_lr_ratio (a ratio of each group's peak LR)")
    kwargs["min_lr_rate"] = kwargs.get("min_lr_rate", ratio)
    return {**training, "lr_scheduler_type": "cosine_with_min_lr", "lr_scheduler_kwargs": kwargs}
