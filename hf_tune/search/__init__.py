"""Hyperparameter search from the recipe's ``search`` section (Optuna, or Ray Tune): ``search(recipe)`` in a notebook,
``python -m hf_tune.search RECIPE`` under any launcher, ``hf-tune search RECIPE`` from the shell.

backend.py is the interface (study paths, the base recipe, the table of backends); storage.py opens the study's
storage, sampling.py turns the space into Optuna samplers and trial recipes, trials.py runs the trials by ask and tell
(under DDP too; pruning.py prunes them), cross_validated.py the trials of a k-fold study (search.cv), ray_backend.py a
study on Ray Tune; summary.py is the one writer of the study folder (trials table, best recipe, plots).

``hf_tune.search`` is the function: ``hf_tune/__init__.py`` imports it from this package, so running the package's
``__main__`` never replaces it (a submodule is bound to its parent only when the parent package is first imported).
This module stays light (Optuna loads with the first search), so ``import hf_tune`` does too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hf_tune.runtime.process import settle_process

if TYPE_CHECKING:
    from hf_tune.recipe.schema import Recipe

__all__ = ["format_summary", "search"]


def search(recipe: Recipe) -> dict:
    """Run (or continue) the recipe's study; the trials table, best recipe and plots go to the study folder. The
    backend is ``search.backend`` (``hf_tune.catalog.search_backends``): Optuna by default (with ``search.cv: k``
    each trial is the mean over k folds), or Ray Tune (ASHA, PBT)."""
    from hf_tune.search.backend import run_search  # here: this package stays light (Optuna loads with a search)

    settle_process()  # as train() does: asked to run, hf_tune makes its process-wide settings
    return run_search(recipe)


def format_summary(result: dict) -> str:
    """The study's trials and best trial, as printed by ``hf-tune search``."""
    from hf_tune.search.summary import format_summary as summary_text  # here: this package stays light

    return summary_text(result)
