"""The search backends behind one interface: where a study lives (``StudyPaths``: its folder, its name, its trials'
folders), the recipe every trial starts from (``base_recipe``), and the study run or read on its backend (the table
``hf_tune.catalog.search_backends``). This module stays light: a backend's module (Optuna, Ray) is imported only when
its study runs or is read.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from hf_tune import run_folder
from hf_tune.catalog.search_backends import DEFAULT_SEARCH_BACKEND, SEARCH_BACKENDS, SearchBackend
from hf_tune.errors import RecipeError
from hf_tune.recipe.schema import Recipe

STUDY_JSON = "study.json"  # in a study folder: which backend ran it, its name, metrics and trials (summary.py)


def trial_folder_name(number: int) -> str:
    """The folder of trial ``number`` inside the study folder, for every backend."""
    return f"trial-{number}"


@dataclasses.dataclass(frozen=True)
class StudyPaths:
    """Where a study lives: its folder (``search.output_dir``, else ``training.output_dir``) and its name
    (``search.study_name``, else the recipe file's stem)."""

    folder: Path
    name: str

    def trial_folder(self, number: int) -> Path:
        return self.folder / trial_folder_name(number)


def study_paths(recipe: Recipe) -> StudyPaths:
    """The study folder and name of a recipe with a search section."""
    spec = recipe.search
    if spec is None:
        raise RecipeError("search", "the recipe has no search section", fix="add search.space (see docs/search.md)")
    folder = Path(spec.output_dir or recipe.training["output_dir"])
    return StudyPaths(folder, spec.study_name or (recipe.source.stem if recipe.source else "study"))


def base_recipe(recipe: Recipe, study_dir: Path) -> Recipe:
    """The recipe every trial starts from: training into the study folder, searched training keys at their low
    value in the declared type, no search section."""
    from hf_tune.search.sampling import typed  # here: sampling loads Optuna, and this module stays light

    training = {**recipe.training, "output_dir": str(study_dir)}
    for key, dist in recipe.search.space.items():
        if key.startswith("training.") and dist.type != "categorical":
            training[key.removeprefix("training.")] = typed(dist, dist.low)
    return dataclasses.replace(recipe, training=training, search=None)


@dataclasses.dataclass(frozen=True)
class StudyTrial:
    """A finished or pruned trial as a backend reads it back: its values per metric and its reported curve."""

    study_name: str
    number: int
    state: str  # "complete" or "pruned"
    params: dict[str, Any]
    values: dict[str, float]
    curve: tuple[str, list[int], list[float]] | None = None  # (metric, steps, values) as the trial reported them


def run_search(recipe: Recipe) -> dict:
    """Run (or continue) the recipe's study on its backend (``search.backend``)."""
    study_paths(recipe)  # a recipe without a search section is refused here
    return SEARCH_BACKENDS[recipe.search.backend].load("run")(recipe)


def study_backend(folder: Path) -> SearchBackend | None:
    """The backend that wrote the study folder (its ``study.json``; an Optuna database alone: Optuna), or None when
    the folder is not a study's."""
    marker = folder / STUDY_JSON
    if marker.is_file():
        return SEARCH_BACKENDS[json.loads(marker.read_text())["backend"]]
    return SEARCH_BACKENDS[DEFAULT_SEARCH_BACKEND] if (folder / run_folder.STUDY_DB).is_file() else None


def read_study_trials(folder: Path) -> list[StudyTrial]:
    """The finished and pruned trials of the study in ``folder``, whichever backend ran it."""
    backend = study_backend(folder)
    if backend is None:
        return []
    return backend.load("read_trials")(folder)
