"""Checks of the data sources, made when the recipe loads: a mixture's weights, epochs and formats agree.
Pure: reads the recipe only."""

from __future__ import annotations

from hf_tune.catalog.formats import format_names
from hf_tune.catalog.methods import method_of
from hf_tune.errors import RecipeError
from hf_tune.recipe.schema import Recipe

MIXABLE_FORMATS = format_names(mixable=True)  # all become input_ids + labels


def check_sources(recipe: Recipe) -> None:
    data = recipe.data
    sources = data.train_sources
    mixture = isinstance(data.train, list)
    if mixture and not sources:
        raise RecipeError("data.train", "is an empty list", fix="give one source, or a list of sources")
    if mixture and (method_of(recipe.method).uses_trl or data.format not in MIXABLE_FORMATS):
        raise RecipeError("data.train", f"a list of sources (a mixture) takes the formats {', '.join(MIXABLE_FORMATS)}"
                          f" with method 'sft'; this recipe reads {data.format!r} with method {recipe.method!r}",
                          fix="give data.train one source")
    weighted = [key for key, source in sources if source.weight is not None]
    for key, source in sources:
        if source.format is not None and source.format != data.format and (
                source.format not in MIXABLE_FORMATS or data.format not in MIXABLE_FORMATS):
            raise RecipeError(f"{key}.format", f"{source.format!r}: a source may differ from data.format "
                              f"({data.format!r}) only among {', '.join(MIXABLE_FORMATS)}",
                              fix="remove it, or use one of those formats")
        if source.weight is not None and source.epochs is not None:
            raise RecipeError(f"{key}.weight", "is set together with epochs",
                              fix="weights draw sources by probability; epochs fix each source's count: choose one")
        if source.columns and len(set(source.columns.values())) != len(source.columns):
            raise RecipeError(f"{key}.columns", "maps two of the format's columns to one column of the data")
    if weighted and not mixture:
        raise RecipeError(f"{weighted[0]}", "weights a single source", fix="remove weight, or list several sources")
    if weighted and len(weighted) != len(sources):
        missing = next(key for key, source in sources if source.weight is None)
        raise RecipeError(f"{missing}.weight", "is missing: give every source of a weighted mixture a weight",
                          fix="add weight to every source, or use epochs (passes over each source) instead")
    if data.streaming:
        _check_streaming(recipe)
    if data.eval is not None and (data.eval.weight is not None or data.eval.epochs is not None):
        raise RecipeError("data.eval", "weight and epochs apply to training sources", fix="remove them from data.eval")


def _check_streaming(recipe: Recipe) -> None:
    data = recipe.data
    if not int(recipe.training.get("max_steps") or -1) > 0:
        raise RecipeError("training.max_steps", "is needed with data.streaming: a stream has no length, so Trainer "
                          "cannot tell how many steps an epoch is", fix="set training.max_steps (e.g. 1000)")
    if data.eval_split:
        raise RecipeError("data.eval_split", "cannot hold out a fraction of a stream",
                          fix="set data.eval to a file or split (read whole, not streamed)")
    if method_of(recipe.method).uses_trl or data.format not in MIXABLE_FORMATS:
        raise RecipeError("data.streaming", f"streams the formats {', '.join(MIXABLE_FORMATS)} with method 'sft'",
                          fix="remove data.streaming")
    for key, source in data.train_sources:
        if source.epochs is not None:
            raise RecipeError(f"{key}.epochs", "a stream is read once per pass", fix="use weight, or remove epochs")
