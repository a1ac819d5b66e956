"""Where ``model.chunked_loss`` can apply, checked when the recipe loads: hf_tune's own SFT of a causal LM, with the
LM head whole on every rank (the loss reads its weight outside the model's forward)."""

from __future__ import annotations

from hf_tune.catalog.methods import method_of
from hf_tune.catalog.tasks import task_of
from hf_tune.errors import RecipeError
from hf_tune.recipe.quantization import weight_sharding
from hf_tune.recipe.schema import Recipe

KEY = "model.chunked_loss"


def check_chunked_loss(recipe: Recipe) -> None:
    """``RecipeError`` naming ``model.chunked_loss`` where it is on and cannot apply."""
    if not recipe.model.chunked_loss:
        return
    if method_of(recipe.method).uses_trl:
        raise RecipeError(KEY, f"is implemented for method sft, and the recipe's method is {recipe.method!r} (its "
                          "trainer computes its own log-probabilities)", fix="remove model.chunked_loss")
    if not task_of(recipe.model.task).causal:
        raise RecipeError(KEY, f"applies to causal LM training, and model.task is {recipe.model.task!r}",
                          fix="remove model.chunked_loss")
    sharded = weight_sharding(recipe)
    if sharded is not None:
        raise RecipeError(KEY, f"reads the LM head's weight outside the model's forward, and {sharded[0]} shards it "
                          f"over ranks ({sharded[1]})", fix="remove model.chunked_loss, or use ZeRO-2 / DDP")
