"""Crash-safe checkpoints: a checkpoint counts only once a completeness marker says every file was written.

Trainer writes ``checkpoint-N`` in place; a kill during that write leaves a folder that resuming would crash on.
After Trainer has saved (``on_save``), ``CheckpointMarker`` records every file and its size in
``hf_tune_complete.json`` (written aside and renamed, so the marker itself is atomic). Resuming picks the newest
checkpoint whose marker matches what is on disk; any other checkpoint folder is ignored.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

from transformers import TrainerCallback

from hf_tune import run_folder
from hf_tune.errors import EXIT_DIVERGED, HfTuneError, RecipeError
from hf_tune.run_folder import checkpoints, is_complete, last_complete_checkpoint, mark_complete  # noqa: F401
from hf_tune.runtime.distributed import decided_on_main, ranks_without, wait_for_every_rank

logger = logging.getLogger(__name__)
MARKER = run_folder.CHECKPOINT_MARKER
FINISHED = run_folder.MANIFEST  # the manifest; its end_time marks a finished run


def resume_checkpoint(output_dir: Path, mode: str, restore: Callable[[Path], object] | None = None) -> str | None:
    """What to resume from, by ``training.resume_from_checkpoint``: "auto" (default), "never", or a path.
    ``restore(output_dir)``: run first under "auto", on the main process (the checkpoint mirror's download).

    The main process decides and every rank takes its answer (each rank looking for itself could pick another
    checkpoint, or none, and train from another step); every rank must then see that checkpoint."""
    def decide():
        if restore is not None and mode == "auto":
            restore(output_dir)
        return _choose_checkpoint(output_dir, mode)

    choice = decided_on_main(decide)
    if choice is None:
        return None
    path = Path(mode) if mode not in ("auto", "never") else output_dir / choice  # each rank's own view of it
    missing = ranks_without(path, is_complete)
    if missing:
        raise HfTuneError(f"training.output_dir: the run resumes from {choice}, but rank(s) {missing} do not see "
                          f"it complete at {path}\n  fix: put training.output_dir on storage that every node shares, "
                          "or set training.save_on_each_node: true so that each node keeps its own checkpoints")
    return str(path)


def refuse_a_checkpoint_with_nothing_left(checkpoint: Path, max_steps: int) -> None:
    """A checkpoint already at ``max_steps`` (a run killed after its last save, before it ended): Trainer would resume
    it and train one step past max_steps, changing the trained model. Refused, naming the checkpoint to use."""
    try:
        step = json.loads((checkpoint / run_folder.TRAINER_STATE).read_text())["global_step"]
    except (OSError, ValueError, KeyError, TypeError):
        return  # Trainer's own resume reports a checkpoint it cannot read
    if max_steps > 0 and step >= max_steps:
        raise RecipeError("training.max_steps", f"{checkpoint} is already at step {step} of {max_steps}: nothing is "
                          "left to train, and resuming it would train one step more", fix=f"use {checkpoint} as the "
                          "trained model (hf-tune chat / merge / push take a checkpoint folder), or raise "
                          "training.max_steps to train on from it")


def _finished(output_dir: Path) -> bool:
    """The manifest says the run ended. One cut short (a crash while it was written) says nothing: the run resumes
    from its newest complete checkpoint and writes it again."""
    try:
        manifest = json.loads((output_dir / FINISHED).read_text())
    except FileNotFoundError:
        return False
    except ValueError as err:  # cut short or not JSON; a file that cannot be read at all (OSError) is raised
        logger.warning("%s is unreadable (%s): treating the run as unfinished", output_dir / FINISHED, err)
        return False
    return isinstance(manifest, dict) and bool(manifest.get("end_time"))


def _choose_checkpoint(output_dir: Path, mode: str) -> str | None:
    key = "training.resume_from_checkpoint"
    if mode not in ("auto", "never"):
        path = Path(mode)
        if not is_complete(path):
            raise RecipeError(key, f"{path} is not a complete hf_tune checkpoint (no {MARKER} matching its files)",
                              fix="name a checkpoint-N folder written by an hf_tune run, or use 'auto'")
        return str(path)
    finished = _finished(output_dir)
    if finished:
        raise RecipeError("training.output_dir", f"{output_dir} holds a finished run",
                          fix=f"choose a new training.output_dir, or continue from one of its checkpoints with "
                          f"training.resume_from_checkpoint={output_dir}/checkpoint-N")
    found = checkpoints(output_dir)
    if mode == "never":
        if found or (output_dir / run_folder.RECIPE).exists():
            raise RecipeError(key, f"is 'never' but {output_dir} already holds a run",
                              fix="use an empty training.output_dir, or resume_from_checkpoint: auto")
        return None
    latest = last_complete_checkpoint(output_dir)
    for partial in found:
        if not is_complete(partial) and (latest is None or partial.name != latest.name):
            logger.warning("Ignoring %s: it was not completely written (the run stopped while saving it)", partial)
    if latest is not None:
        logger.info("Resuming from %s (the newest complete checkpoint in %s)", latest, output_dir)
    return latest.name if latest else None


class CheckpointMarker(TrainerCallback):
    """Marks each checkpoint complete once Trainer has written all of it: by the process that saves the model (the
    main process, or each node's with ``save_on_each_node``)."""

    def on_save(self, args, state, control, **kwargs):
        # every rank's part (ZeRO optimizer shards, its RNG state) is written before the marker lists the folder: a
        # size taken mid-write would leave a good checkpoint counted incomplete forever (every rank calls on_save)
        wait_for_every_rank()
        if args.should_save:
            # a search trial saves into its own folder under output_dir (Trainer names it with hp_name)
            run_dir = Path(args.output_dir) / (state.trial_name if state.is_hyper_param_search and state.trial_name
                                               else "")
            checkpoint = run_dir / f"checkpoint-{state.global_step}"
            if checkpoint.is_dir():
                mark_complete(checkpoint)


class NonFiniteLoss(HfTuneError):
    """Raised when a training step's loss is NaN or infinite; the CLI exits with status 3 (a diverged run)."""

    exit_code = EXIT_DIVERGED
    step: int | None = None  # the first optimizer step (1-based) whose loss was not finite, where the guard knows it
