"""Recipes: YAML loading, command-line overrides, validation, and the resolved form saved with each run."""

from hf_tune.recipe.loading import Recipe, apply_overrides, load_recipe, redact_secrets
from hf_tune.recipe.schema import DataSection, DatasetSource, ModelSection

__all__ = [
    "DataSection",
    "DatasetSource",
    "ModelSection",
    "Recipe",
    "apply_overrides",
    "load_recipe",
    "redact_secrets",
]
