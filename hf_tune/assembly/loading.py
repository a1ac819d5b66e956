"""``load_recipe``, what users call: read and validate a recipe (``hf_tune.recipe``, pure), then run the preflight
checks that ask a builder or the Hub (``hf_tune.assembly.preflight``). Everything that can fail before the first
step fails here."""

from __future__ import annotations

import os
from typing import Any

from hf_tune.assembly.preflight import preflight
from hf_tune.recipe import Recipe, read_recipe


def load_recipe(recipe: str | os.PathLike | dict[str, Any], overrides: list[str] | None = None) -> Recipe:
    """Read a recipe (a YAML path or a dict), apply ``section.key=value`` overrides, validate every section, and
    run the preflight checks: everything that can fail before the first step fails here. The schedule is resolved
    when TrainingArguments are built (and shown resolved in recipe.yaml and ``hf-tune validate``)."""
    recipe = read_recipe(recipe, overrides)
    preflight(recipe)
    return recipe
