"""``hf-tune cv RECIPE``: stratified k-fold cross-validation of a classification recipe (``search/folds.py``), each
metric's mean and spread over the folds."""

from __future__ import annotations

from hf_tune.commands.option_types import whole
from hf_tune.commands.verb import Verb, option


def run(args) -> None:
    from hf_tune.assembly.loading import load_recipe  # loads transformers: only when the verb runs
    from hf_tune.search.folds import cross_validate

    result = cross_validate(load_recipe(args.recipe, args.overrides), args.folds)
    for name, stats in result["summary"].items():
        print(f"{name}: {stats['mean']:.4f} ± {stats['std']:.4f}")


VERB = Verb(run, "stratified k-fold cross-validation of a classification recipe", True,
            (option("--folds", type=whole(2), default=5),))
