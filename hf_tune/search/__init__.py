"""Hyperparameter search from the recipe's ``search`` section (Optuna, or Ray Tune): ``search(recipe)`` in a notebook,
``python -m hf_tune.search RECIPE`` under any launcher, ``hf-tune search RECIPE`` from the shell.

storage.py opens the study's storage, sampling.py turns the space into Optuna samplers and trial recipes,
trials.py runs the trials (under DDP too), cross_validated.py the trials of a k-fold study (search.cv), summary.py
writes the trials table, best recipe and plots.

``hf_tune.search`` is the function: ``hf_tune/__init__.py`` imports it from this package, so running the package's
``__main__`` never replaces it (a submodule is bound to its parent only when the parent package is first imported).
This module stays light (Optuna loads with the first search), so ``import hf_tune`` does too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hf_tune.recipe.schema import Recipe

__all__ = ["format_summary", "search"]


def search(recipe: Recipe) -> dict:
    """Run (or continue) the recipe's study; the trials table, best recipe and plots go to the study folder. With
    ``search.backend: ray`` the study runs on Ray Tune (ASHA, PBT: ``hf_tune.search.ray_backend``); with
    ``search.cv: k`` each trial is the mean over k folds (``hf_tune.search.cross_validated``)."""
    if recipe.search is not None and recipe.search.backend == "ray":
        from hf_tune.search.ray_backend import search_with_ray

        return search_with_ray(recipe)
    if recipe.search is not None and recipe.search.cv is not None:
        from hf_tune.search.cross_validated import search_cross_validated

        return search_cross_validated(recipe)
    from hf_tune.search.trials import search as run_search

    return run_search(recipe)


def format_summary(result: dict) -> str:
    """The study's trials and best trial, as printed by ``hf-tune search``."""
    from hf_tune.search.summary import format_summary as summary_text

    return summary_text(result)
