"""``hf-tune search RECIPE``: the hyperparameter search of the recipe's ``search`` section (``hf_tune.search``:
Optuna or Ray Tune), and its summary."""

from __future__ import annotations

from hf_tune.commands.verb import Verb, option
from hf_tune.search import format_summary, search


def run(args) -> None:
    from hf_tune.assembly.loading import load_recipe  # loads transformers: only when the verb runs

    recipe = load_recipe(args.recipe, args.overrides)
    if args.dashboard:
        from hf_tune.search.dashboard import dashboard_instructions  # loads Optuna

        print(dashboard_instructions(recipe), flush=True)
    print(format_summary(search(recipe)))


VERB = Verb(run, "hyperparameter search from the recipe's search section (Optuna or Ray Tune)", True, (
    option("--dashboard", action="store_true", help="first print how to open optuna-dashboard on the study's storage "
           "(pip install 'hf_tune[dashboard]')"),))
