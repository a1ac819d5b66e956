"""``python -m hf_tune.run RECIPE`` and ``hf-tune train RECIPE``: load the recipe, train it
(``hf_tune.workflows.train``), and say how to use the run folder."""

from __future__ import annotations

import logging

from hf_tune.catalog.tasks import task_of
from hf_tune.commands.command_line import configure_logging, launcher_parser, user_errors
from hf_tune.commands.verb import Verb
from hf_tune.recipe.schema import Recipe
from hf_tune.runtime.distributed import end_process_group

logger = logging.getLogger("hf_tune")


def main(argv: list[str] | None = None) -> None:
    """``python -m hf_tune.run RECIPE [section.key=value ...]`` (``hf-tune train``): load the recipe, train, and print
    how to use the run folder (on the main process)."""
    from hf_tune.assembly.loading import load_recipe  # loads transformers: after the arguments parse
    from hf_tune.workflows.train import train

    args = launcher_parser("python -m hf_tune.run", "train from a recipe, under any launcher").parse_args(argv)
    configure_logging()
    with user_errors(args.debug):
        recipe = load_recipe(args.recipe, args.overrides)
        trainer = train(recipe)
    if trainer.is_world_process_zero():
        print(how_to_use(recipe, trainer.args.output_dir))
    end_process_group()


def how_to_use(recipe: Recipe, output_dir: str) -> str:
    task = task_of(recipe.model.task)
    lines = [f"\nRun folder: {output_dir}"]
    if task.causal:
        lines.append(f"  chat with it:  hf-tune chat {output_dir}")
    if recipe.lora is not None:  # hf_tune resolves the adapter's base wherever the folder goes (embedded: too)
        lines.append(f"  load it:       from hf_tune import load_model; model = load_model({str(output_dir)!r})")
    else:
        lines.append(f"  load it:       from transformers import {task.auto_class} as Auto; "
                     f"model = Auto.from_pretrained({str(output_dir)!r})")
    return "\n".join(lines)


def run(args) -> None:
    main([args.recipe, *args.overrides] + (["--debug"] if args.debug else []))


VERB = Verb(run, "train from a recipe (same as python -m hf_tune.run)", True)
