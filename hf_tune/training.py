"""``train(recipe)``: the calls that turn a recipe into a finished run folder (what ``python -m hf_tune.run`` does)."""

from __future__ import annotations

import logging
from pathlib import Path

import yaml

from hf_tune.recipe import Recipe, redact_secrets

logger = logging.getLogger("hf_tune")


def train(recipe: Recipe):
    """Build everything from the recipe, train (resuming from the newest complete checkpoint unless the recipe says
    otherwise), and fill the run folder. Returns the trainer."""
    from transformers import set_seed

    from hf_tune.checkpoints import resume_checkpoint
    from hf_tune.data import build_datasets
    from hf_tune.modeling import build_model_and_tokenizer
    from hf_tune.distributed import check_distributed, fit_cpu_threads
    from hf_tune.manifest import now
    from hf_tune.tracking import tracking_scope
    from hf_tune.training_args import build_training_arguments

    started = now()
    args = build_training_arguments(recipe)
    check_distributed(args)
    fit_cpu_threads(args)
    run_dir = Path(args.output_dir)
    resume = resume_checkpoint(run_dir, recipe.training.get("resume_from_checkpoint") or "auto")
    set_seed(args.seed)  # the model's freshly initialised weights (heads, LoRA) are seeded too
    model, tokenizer = build_model_and_tokenizer(recipe)
    datasets = build_datasets(recipe, tokenizer, args)  # bad data fails here, before anything is written
    with tracking_scope(recipe, run_dir):  # this run's tracker settings; the process environment is restored after
        return _train_built(recipe, args, resume, started, model, tokenizer, datasets)


def _train_built(recipe: Recipe, args, resume: str | None, started: str, model, tokenizer, datasets):
    from hf_tune.errors import stage_errors
    from hf_tune.manifest import now, write_manifest
    from hf_tune.recipe.upstream import blame_key
    from hf_tune.report import write_report
    from hf_tune.trainer import build_trainer

    run_dir = Path(args.output_dir)
    train_dataset, eval_dataset = datasets
    with stage_errors(lambda message: blame_key("training", recipe.training, message), "building the Trainer"):
        trainer = build_trainer(recipe, model, tokenizer, train_dataset, eval_dataset, args)
    main = trainer.is_world_process_zero()
    datasets = {"train": train_dataset, "eval": eval_dataset}
    logger.info("rank %d of %d on %s", args.process_index, args.world_size, args.device)
    if main:
        save_resolved_recipe(recipe, run_dir)
        write_manifest(run_dir, recipe, args, datasets, started)
    result = trainer.train(resume_from_checkpoint=resume)
    trainer.save_model()  # adapter (LoRA) or full model, plus the tokenizer and its chat template
    trainer.log_metrics("train", result.metrics)
    trainer.save_metrics("train", result.metrics)
    metrics = dict(result.metrics)
    if eval_dataset is not None:
        evaluation = trainer.evaluate()
        trainer.log_metrics("eval", evaluation)
        trainer.save_metrics("eval", evaluation)
        metrics.update(evaluation)
    trainer.save_state()
    if main:
        write_report(run_dir)
        write_manifest(run_dir, recipe, args, datasets, started, end_time=now(), metrics=metrics)
    return trainer


def save_resolved_recipe(recipe: Recipe, output_dir: Path) -> Path:
    output_dir.mkdir(parents=True, exist_ok=True)
    path = output_dir / "recipe.yaml"
    path.write_text(yaml.safe_dump(redact_secrets(recipe.to_dict()), sort_keys=False))
    return path


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
