"""The shipped ``evaluate`` metric modules (loaded by path, so they work offline), and how a recipe names a metric."""

from __future__ import annotations

from pathlib import Path

from hf_tune.errors import RecipeError

SHIPPED_METRICS = {path.stem: path for path in Path(__file__).parent.glob("*.py") if path.stem != "__init__"}


def metric_path(name: str) -> str:
    """A shipped metric name (accuracy, f1) or a path to an ``evaluate`` module file or folder."""
    if name in SHIPPED_METRICS:
        return str(SHIPPED_METRICS[name])
    if Path(name).exists():
        return name
    raise RecipeError("evaluation.metrics", f"unknown metric {name!r}",
                      fix=f"use one of {sorted(SHIPPED_METRICS)} or a path to an evaluate module (.py)")
