"""``hf-tune validate RECIPE``: the recipe checked and printed fully resolved, what hf_tune decides where it is
silent marked as its default (``workflows/validate.py``)."""

from __future__ import annotations

from hf_tune.commands.verb import Verb


def run(args) -> None:
    from hf_tune.assembly.loading import load_recipe  # loads transformers: only when the verb runs
    from hf_tune.workflows.validate import effective_recipe

    print(effective_recipe(load_recipe(args.recipe, args.overrides)), end="")


VERB = Verb(run, "check a recipe and print it fully resolved", True)
