"""``python -m hf_tune.run RECIPE [section.key=value ...]``: the same code under every launcher
(python, ``accelerate launch -m``, ``torchrun -m``, ``deepspeed --module``)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys

from hf_tune.errors import HfTuneError
from hf_tune.recipe import load_recipe


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hf_tune.run", description=__doc__.splitlines()[0])
    p.add_argument("recipe", help="YAML recipe, e.g. recipes/llm_lora.yaml")
    p.add_argument("overrides", nargs="*", help="section.key=value, value read as YAML (training.max_steps=10)")
    p.add_argument("--debug", action="store_true", help="show the traceback of errors")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed launcher
    return p


@contextlib.contextmanager
def user_errors(debug: bool):
    """Print an HfTuneError as one message and exit 2; ``--debug`` shows the traceback instead, down to the library
    error it wraps (a stage wraps what it raised with ``raise ... from err``: see hf_tune.errors)."""
    try:
        yield
    except HfTuneError as err:
        if debug:
            raise
        print(f"hf_tune: error: {err}", file=sys.stderr)
        if err.__cause__ is not None:
            print("  (--debug shows the traceback)", file=sys.stderr)
        raise SystemExit(2) from None


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    with user_errors(args.debug):
        from hf_tune.training import how_to_use, train

        recipe = load_recipe(args.recipe, args.overrides)
        trainer = train(recipe)
    if trainer.is_world_process_zero():
        print(how_to_use(recipe, trainer.args.output_dir))


if __name__ == "__main__":
    main()
