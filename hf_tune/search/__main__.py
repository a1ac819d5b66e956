"""``python -m hf_tune.search RECIPE [section.key=value ...]``: a hyperparameter search under any launcher
(python, ``torchrun -m``, ``accelerate launch -m``, ``deepspeed --module``). The search itself is the recipe's backend
(``hf_tune.search.backend``)."""

from __future__ import annotations

import sys

from hf_tune.commands.command_line import configure_logging, launcher_parser, plain_progress_off_a_terminal, user_errors
from hf_tune.runtime.process import settle_process

plain_progress_off_a_terminal()  # before the libraries below load: tqdm reads it at its import
settle_process()  # before torch loads: MKL reads MKL_CBWR at its first call

from hf_tune.assembly.loading import load_recipe  # noqa: E402  after the two calls above, which must come first
from hf_tune.runtime.distributed import end_process_group  # noqa: E402
from hf_tune.search import format_summary, search  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    args = launcher_parser("python -m hf_tune.search", __doc__.splitlines()[0]).parse_args(argv)
    configure_logging()
    with user_errors(args.debug):
        result = search(load_recipe(args.recipe, args.overrides))
    if result:
        print(format_summary(result))
    end_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
