"""``train(recipe)``: the calls that turn a recipe into a finished run folder (``python -m hf_tune.run`` and
``hf-tune train`` call it from ``hf_tune.commands.train``)."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path

import yaml
from transformers import TrainerCallback

from hf_tune import run_folder
from hf_tune.assembly.decisions import ran
from hf_tune.assembly.run_build import Run, build_run
from hf_tune.catalog.tasks import task_of
from hf_tune.data.preview import first_example_for_the_log
from hf_tune.errors import HfTuneError
from hf_tune.recipe.schema import Recipe
from hf_tune.records.manifest import now, write_manifest
from hf_tune.records.model_card import render_model_card
from hf_tune.records.report import write_report
from hf_tune.records.resolved_recipe import resolved_recipe_dict
from hf_tune.records.tracking import tracking_scope
from hf_tune.redaction import redact_secrets
from hf_tune.runtime.distributed import check_distributed
from hf_tune.runtime.process import settle_process
from hf_tune.trainer.checkpoints import refuse_a_checkpoint_with_nothing_left, resume_checkpoint
from hf_tune.trainer.mirror import mirror_restore, mirror_uploads
from hf_tune.trainer.monitors import monitors_of
from hf_tune.trainer.profiling import StepProfiler, profile_dir
from hf_tune.trainer.rollback import earlier_rollbacks, skipped_batches, train_with_rollbacks
from hf_tune.trainer.world_size import fit_world_size
from hf_tune.training_args import build_training_arguments

logger = logging.getLogger("hf_tune")


def train(recipe: Recipe, callbacks: Sequence[TrainerCallback] = ()):
    """Build everything from the recipe, train (resuming from the newest complete checkpoint unless the recipe says
    otherwise), and fill the run folder. Returns the trainer. ``callbacks``: the caller's, attached after hf_tune's.
    A run stopped by SIGTERM / SIGUSR1 raises ``Preempted`` once its checkpoint is saved (the run is not finished).
    Makes hf_tune's process-wide settings (``settle_process``), which importing hf_tune never makes."""
    settle_process()
    started = now()
    args = build_training_arguments(recipe)
    run_dir = Path(args.output_dir)
    check_distributed(args)  # a launch that is not really distributed is refused before the ranks talk
    resume = resume_checkpoint(run_dir, recipe.training.get("resume_from_checkpoint") or "auto",
                               restore=mirror_restore(recipe.resilience.checkpoint_mirror))  # a fresh machine
    if resume is not None:  # on another world size: the accumulation that keeps the global batch, or a refusal
        fitted = fit_world_size(recipe, args, Path(resume))
        if fitted is not recipe:
            recipe, args = fitted, build_training_arguments(fitted)
        refuse_a_checkpoint_with_nothing_left(Path(resume), args.max_steps)
    # torch.profiler over the recipe's profiled steps, into RUN_DIR/profile/
    profiler = [StepProfiler(recipe.profile, profile_dir(run_dir))] if recipe.profile is not None else []
    # bad data, a bad model or a run that cannot fit fails here, before anything is written (the launch: checked above)
    run = build_run(recipe, args, check_launch=False, callbacks=[*profiler, *callbacks])
    with tracking_scope(recipe, run_dir, run.trainer, lineage_datasets(run)):  # this run's trackers, restored after
        # resilience.checkpoint_mirror: every upload awaited before leaving
        with mirror_uploads(run.trainer, monitors_of(run.trainer).mirror):
            return _train(run, resume, started)


def _train(run: Run, resume: str | None, started: str):
    recipe, args, trainer = run.recipe, run.args, run.trainer
    run_dir = Path(args.output_dir)
    main = trainer.is_world_process_zero()
    datasets = lineage_datasets(run)
    decided = ran(run).to_dict()  # what this run runs: plan's and validate's decisions, and any fallback recorded
    logger.info("rank %d of %d on %s", args.process_index, args.world_size, args.device)
    rollbacks = earlier_rollbacks(run_dir)  # resilience.rollback_on_nonfinite, in run.json: read before rewriting it
    resumed = Path(resume).name if resume else None
    if main:
        save_resolved_recipe(recipe, run_dir)
        write_manifest(run_dir, recipe, args, datasets, started, resumed_from=resumed, rollbacks=rollbacks,
                       decisions=decided)
        shown = first_example_for_the_log(recipe, run.data.train, run.tokenizer)
        if shown is not None:  # what trains, as hf-tune data shows it
            logger.info("The first training example, trained tokens between [[ ]]:\n%s", shown)
    try:
        result = train_with_rollbacks(trainer, resume, recipe.resilience.rollback_on_nonfinite, rollbacks,
                                      monitors_of(trainer).step_skips, on_rollback=(
            lambda done: main and write_manifest(run_dir, recipe, args, datasets, started, resumed_from=resumed,
                                             rollbacks=done, decisions=decided)))
    except ValueError as err:
        if resume is None or "parameter group" not in str(err):  # torch's optimizer load_state_dict checks
            raise
        raise HfTuneError(
            f"training.resume_from_checkpoint: {resume} holds an optimizer whose parameter groups differ from the "
            f"ones this recipe builds ({err})\n  fix: restore the keys that decide which parameters share a group "
            "(weight_decay zero or not, optim.layerwise_lr_decay, optim.head_lr, optim.no_decay, lora); learning "
            "rates and weight decay values may change on resume, the grouping may not") from None
    save_final_model(trainer)
    if main:
        save_class_labels(trainer, recipe, run_dir)
    trainer.log_metrics("train", result.metrics)
    trainer.save_metrics("train", result.metrics)
    metrics = dict(result.metrics)
    if run.data.eval is not None:
        evaluation = trainer.evaluate()
        trainer.log_metrics("eval", evaluation)
        trainer.save_metrics("eval", evaluation)
        metrics.update(evaluation)
    trainer.save_state()
    if main:
        write_report(run_dir)
        write_manifest(run_dir, recipe, args, datasets, started, resumed_from=resumed, end_time=now(),
                       metrics=metrics, rollbacks=skipped_batches(rollbacks, monitors_of(trainer).step_skips),
                       decisions=decided)
        write_run_card(run_dir)
    return trainer


def write_run_card(run_dir: Path) -> None:
    """hf_tune's model card as the folder's README.md (PEFT's save leaves an empty template there): the card
    ``hf-tune push`` uploads, with the folder's path for a repo id."""
    (run_dir / "README.md").write_text(str(render_model_card(run_dir, str(run_dir), local=True)), encoding="utf-8")


def save_class_labels(trainer, recipe: Recipe, run_dir: Path) -> None:
    """A LoRA classifier's id2label beside its adapter (``class_labels.json``), which merge and the model card read:
    the adapter holds the trained head's weights but not the names of its classes."""
    if recipe.lora is not None and task_of(recipe.model.task).class_labels:
        labels = {"id2label": trainer.model.config.id2label}
        (run_dir / run_folder.CLASS_LABELS).write_text(json.dumps(labels, indent=2) + "\n")


def lineage_datasets(run: Run) -> dict:
    """The datasets run.json and the tracker params describe: train, eval, and each source of a mixture."""
    return {"train": run.data.train, "eval": run.data.eval, **run.data.sources}


def save_resolved_recipe(recipe: Recipe, output_dir: Path) -> Path:
    output_dir.mkdir(parents=True, exist_ok=True)
    path = output_dir / run_folder.RECIPE
    path.write_text(yaml.safe_dump(redact_secrets(resolved_recipe_dict(recipe)), sort_keys=False))
    return path


def save_final_model(trainer) -> None:
    """The adapter (LoRA) or full model into ``output_dir``, with the tokenizer and its chat template (or the
    processor). Under FSDP the state dict is gathered whole first: ``Trainer.save_model`` writes nothing from a
    sharded state dict (the type the checkpoints use)."""
    if trainer.is_fsdp_enabled:
        trainer.accelerator.state.fsdp_plugin.set_state_dict_type("FULL_STATE_DICT")
    trainer.save_model()
