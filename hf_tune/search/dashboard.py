"""``hf-tune search --dashboard``: the command that opens optuna-dashboard on the study's storage, to follow the
trials live (in another terminal, or on another machine that sees the storage)."""

from __future__ import annotations

import importlib.util
import shlex
from pathlib import Path

from hf_tune.catalog.search_backends import SEARCH_BACKENDS
from hf_tune.errors import RecipeError
from hf_tune.recipe.schema import Recipe
from hf_tune.search.backend import study_paths
from hf_tune.search.storage import is_journal, redact_url, storage_url


def dashboard_command(recipe: Recipe, port: int = 8080) -> list[str]:
    """``optuna-dashboard`` with the study's storage (a journal file named as such), as an argument list."""
    if recipe.search is None:
        raise RecipeError("search", "the recipe has no search section", fix="add search.space (see docs/search.md)")
    if not SEARCH_BACKENDS[recipe.search.backend].dashboard:
        raise RecipeError("search.backend", "--dashboard shows Optuna studies; Ray Tune's trials are in the study "
                          "folder's trials.csv and its ray/ experiment", fix="drop --dashboard, or use backend optuna")
    url = storage_url(recipe.search, study_paths(recipe).folder)
    if is_journal(url):
        return ["optuna-dashboard", "--storage-class", "JournalFileStorage", "--port", str(port),
                str(Path(url).resolve())]
    return ["optuna-dashboard", "--port", str(port), url]


def dashboard_instructions(recipe: Recipe, port: int = 8080) -> str:
    """What ``--dashboard`` prints: the command (its password hidden), where to browse, and the extra to install."""
    command = dashboard_command(recipe, port)
    shown = [redact_url(part) if "://" in part else part for part in command]
    lines = [f"dashboard: {shlex.join(shown)}",
             f"  then open http://127.0.0.1:{port} (it follows the study while trials run; rerun it any time)"]
    if shown != command:
        lines.append("  (the storage URL's password is hidden here: put it back in the command)")
    if importlib.util.find_spec("optuna_dashboard") is None:
        lines.append("  optuna-dashboard is not installed: pip install 'hf_tune[dashboard]'")
    return "\n".join(lines)
