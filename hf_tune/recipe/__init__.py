"""Recipes: the schema, YAML loading, command-line overrides and the checks that need nothing built. Pure: reading
a recipe opens no socket, loads no model and starts no process group (``hf_tune.assembly.preflight`` adds those
checks, and ``hf_tune.load_recipe`` runs both)."""

from hf_tune.recipe.loading import read_recipe
from hf_tune.recipe.overrides import apply_overrides, apply_values
from hf_tune.recipe.schema import DataSection, DatasetSource, ModelSection, Recipe
from hf_tune.recipe.validation import validate_recipe
from hf_tune.redaction import redact_secrets

__all__ = [
    "DataSection",
    "DatasetSource",
    "ModelSection",
    "Recipe",
    "apply_overrides",
    "apply_values",
    "read_recipe",
    "redact_secrets",
    "validate_recipe",
]
