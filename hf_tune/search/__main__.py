"""``python -m hf_tune.search RECIPE [section.key=value ...]``: a hyperparameter search under any launcher
(python, ``torchrun -m``, ``accelerate launch -m``, ``deepspeed --module``). The search itself is ``hf_tune.search.trials``."""

from __future__ import annotations

import logging
import sys


def main(argv: list[str] | None = None) -> None:
    from hf_tune.search import format_summary, search
    from hf_tune.recipe import load_recipe
    from hf_tune.run import parser, user_errors

    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    with user_errors(args.debug):
        result = search(load_recipe(args.recipe, args.overrides))
    if result:
        print(format_summary(result))


if __name__ == "__main__":
    main(sys.argv[1:])
