"""``hf-tune data RECIPE``: the first training examples as the model reads them, trained tokens marked, with tokens
per example and per step, examples per pack and the share the loss ignores (``workflows/data_preview.py``)."""

from __future__ import annotations

import sys

from hf_tune.commands.option_types import whole
from hf_tune.commands.verb import Verb, option


def run(args) -> None:
    from hf_tune.assembly.loading import load_recipe  # loads transformers: only when the verb runs
    from hf_tune.workflows.data_preview import data_preview

    colour = sys.stdout.isatty() and not args.no_colour
    print(data_preview(load_recipe(args.recipe, args.overrides), count=args.n, colour=colour))


VERB = Verb(run, "the first training examples as the model reads them, trained tokens marked; tokens per example and "
            "per step, examples per pack, the share the loss ignores", True, (
                option("--n", type=whole(1), default=3, help="examples to show (default 3)"),
                option("--no-colour", action="store_true", help="mark trained tokens with [[ ]] in a terminal too")))
