"""Hyperparameter search from the recipe's ``search`` section (Optuna): ``search(recipe)`` in a notebook,
``python -m hf_tune.search RECIPE`` under any launcher, ``hf-tune search RECIPE`` from the shell.

``hf_tune.search`` is the function: ``hf_tune/__init__.py`` imports it after this package, so running the package's
``__main__`` never replaces it (a submodule is bound to its parent only when the parent package is first imported).
"""

from hf_tune.search.summary import format_summary
from hf_tune.search.trials import search

__all__ = ["format_summary", "search"]
