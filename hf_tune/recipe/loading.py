"""Read a recipe from YAML (or a dict), apply ``section.key=value`` overrides, validate it. Pure: no network, no
model, no process group (``hf_tune.assembly.preflight`` adds the checks that need those)."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import yaml

from hf_tune.errors import RecipeError
from hf_tune.recipe.overrides import apply_overrides, read_yaml
from hf_tune.recipe.schema import SECTIONS, Recipe
from hf_tune.recipe.validation import validate_recipe


def read_recipe(recipe: str | os.PathLike | dict[str, Any], overrides: list[str] | None = None) -> Recipe:
    """Read a recipe (a YAML path or an already-parsed dict), apply overrides, and validate every section.
    ``hf_tune.load_recipe`` is this plus the preflight checks."""
    source = None
    if isinstance(recipe, dict):
        raw = copy.deepcopy(recipe)
    else:
        source = Path(recipe)
        if not source.is_file():
            raise RecipeError("", f"recipe file not found: {source}",
                              fix="pass the path of a YAML recipe, e.g. recipes/llm_lora.yaml")
        try:
            raw = read_yaml(source.read_text()) or {}
        except yaml.YAMLError as err:
            raise RecipeError("", f"{source} is not valid YAML: {err}") from None
    if not isinstance(raw, dict):
        raise RecipeError("", f"a recipe is a mapping of sections {SECTIONS}, got {type(raw).__name__}")
    raw = apply_overrides(raw, overrides or [])
    return validate_recipe(raw, source)
