"""``python -m hf_tune.run RECIPE [section.key=value ...]``: the same code under every launcher
(python, ``accelerate launch -m``, ``torchrun -m``, ``deepspeed --module``)."""

from __future__ import annotations

from hf_tune.commands.command_line import configure_logging, launcher_parser, user_errors
from hf_tune.runtime.distributed import end_process_group
from hf_tune.build.loading import load_recipe
from hf_tune.commands.train import how_to_use, train


def main(argv: list[str] | None = None) -> None:
    """Load the recipe, train, and print how to use the run folder (on the main process)."""
    args = launcher_parser("python -m hf_tune.run", __doc__.splitlines()[0]).parse_args(argv)
    configure_logging()
    with user_errors(args.debug):
        recipe = load_recipe(args.recipe, args.overrides)
        trainer = train(recipe)
    if trainer.is_world_process_zero():
        print(how_to_use(recipe, trainer.args.output_dir))
    end_process_group()


if __name__ == "__main__":
    main()
