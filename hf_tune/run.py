"""``python -m hf_tune.run RECIPE [section.key=value ...]``: the same code under every launcher
(python, ``accelerate launch -m``, ``torchrun -m``, ``deepspeed --module``)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from pathlib import Path

import yaml

from hf_tune.errors import HfTuneError
from hf_tune.recipe import Recipe, load_recipe, redact_secrets

logger = logging.getLogger("hf_tune")


def train(recipe: Recipe):
    """Build everything from the recipe, train, and fill the run folder. Returns the trainer."""
    from transformers import set_seed

    from hf_tune.data import build_datasets
    from hf_tune.modeling import build_model_and_tokenizer
    from hf_tune.trainer import build_trainer
    from hf_tune.training_args import build_training_arguments

    args = build_training_arguments(recipe)
    set_seed(args.seed)  # the model's freshly initialised weights (heads, LoRA) are seeded too
    model, tokenizer = build_model_and_tokenizer(recipe)
    train_dataset, eval_dataset = build_datasets(recipe, tokenizer, args)
    trainer = build_trainer(recipe, model, tokenizer, train_dataset, eval_dataset, args)
    if trainer.is_world_process_zero():
        save_resolved_recipe(recipe, Path(args.output_dir))
    result = trainer.train()
    trainer.save_model()  # adapter (LoRA) or full model, plus the tokenizer and its chat template
    trainer.log_metrics("train", result.metrics)
    trainer.save_metrics("train", result.metrics)
    if eval_dataset is not None:
        metrics = trainer.evaluate()
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)
    trainer.save_state()
    return trainer


def save_resolved_recipe(recipe: Recipe, output_dir: Path) -> Path:
    output_dir.mkdir(parents=True, exist_ok=True)
    path = output_dir / "recipe.yaml"
    path.write_text(yaml.safe_dump(redact_secrets(recipe.to_dict()), sort_keys=False))
    return path


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hf_tune.run", description=__doc__.splitlines()[0])
    p.add_argument("recipe", help="YAML recipe, e.g. recipes/llm_lora.yaml")
    p.add_argument("overrides", nargs="*", help="section.key=value, value read as YAML (training.max_steps=10)")
    p.add_argument("--debug", action="store_true", help="show the traceback of errors")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed launcher
    return p


@contextlib.contextmanager
def user_errors(debug: bool):
    """Print an HfTuneError as one message and exit 2; ``--debug`` shows the traceback instead."""
    try:
        yield
    except HfTuneError as err:
        if debug:
            raise
        print(f"hf_tune: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    with user_errors(args.debug):
        recipe = load_recipe(args.recipe, args.overrides)
        trainer = train(recipe)
    if trainer.is_world_process_zero():
        print(how_to_use(recipe, trainer.args.output_dir))


def how_to_use(recipe: Recipe, output_dir: str) -> str:
    if recipe.lora is not None:
        loader = "from peft import AutoPeftModelForCausalLM as Auto" if recipe.model.task == "causal_lm" else \
            "from peft import AutoPeftModelForSequenceClassification as Auto"
    else:
        loader = "from transformers import AutoModelForCausalLM as Auto" if recipe.model.task == "causal_lm" else \
            "from transformers import AutoModelForSequenceClassification as Auto"
    lines = [f"\nRun folder: {output_dir}"]
    if recipe.model.task == "causal_lm":
        lines.append(f"  chat with it:  hf-tune chat {output_dir}")
    lines.append(f"  load it:       {loader}; model = Auto.from_pretrained({str(output_dir)!r})")
    return "\n".join(lines)

if __name__ == "__main__":
    main()
