"""Every file name of a run folder (``training.output_dir``) and of a search's study folder, named once here (the
trackers' in their table), and which of its checkpoints are complete (files only: read by every verb that opens a run
without loading a library)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

RECIPE = "recipe.yaml"  # the resolved recipe
MANIFEST = "run.json"  # what the run was and how it ended; its end_time marks a finished run
CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")  # Trainer's checkpoint folders
CHECKPOINT_MARKER = "hf_tune_complete.json"  # in a checkpoint: every file and its size, once all are written
TRAINER_STATE = "trainer_state.json"  # Trainer's log history (also in each checkpoint)
TRAIN_RESULTS, EVAL_RESULTS, ALL_RESULTS = "train_results.json", "eval_results.json", "all_results.json"
RESULTS = (TRAIN_RESULTS, EVAL_RESULTS, ALL_RESULTS)
LOSS_PLOT, LR_PLOT, EVAL_METRICS_PLOT = "loss.png", "lr.png", "eval_metrics.png"
LR_SCHEDULE_PLOT = "lr_schedule.png"  # hf-tune plan
ADAPTER_CONFIG, MODEL_CONFIG = "adapter_config.json", "config.json"  # a LoRA run's adapter, or a full model
CLASS_LABELS = "class_labels.json"  # a LoRA run of a classifier: its head's id2label, which the adapter lacks
MERGED = "merged"  # hf-tune merge's default output folder
# each tracker's folder and run-id file: its entry in hf_tune.catalog.trackers
CV_RESULTS = "cv_results.json"  # hf-tune cv
SAMPLES = "samples.jsonl"  # evaluation.samples: one line per prompt per evaluation (step, prompt, completion)
WATCHED_SCORES = "eval_scores.jsonl"  # hf-tune eval: one line per scored checkpoint (step, checkpoint, scores)
PROFILE_DIR = "profile"  # the recipe's profile section, or hf-tune profile: torch.profiler's outputs, in it:
PROFILE_TRACE, PROFILE_TOP_OPS, PROFILE_SUMMARY = "trace.json", "top_ops.csv", "profile.json"
STUDY_DB, TRIALS_CSV, BEST_RECIPE = "study.db", "trials.csv", "best_recipe.yaml"  # a search's study folder


# checkpoints: complete once the marker lists every file at its size (hf_tune.trainer.checkpoints writes it)

def mark_complete(checkpoint: Path) -> None:
    files = {str(p.relative_to(checkpoint)): p.stat().st_size for p in sorted(checkpoint.rglob("*"))
             if p.is_file() and p.name != CHECKPOINT_MARKER}
    # written aside and renamed: two writers (save_on_each_node on shared storage) never interleave
    staging = checkpoint / f".{CHECKPOINT_MARKER}.{os.getpid()}.tmp"
    staging.write_text(json.dumps({"files": files}, indent=1))
    os.replace(staging, checkpoint / CHECKPOINT_MARKER)


def is_complete(checkpoint: Path) -> bool:
    try:
        files = json.loads((checkpoint / CHECKPOINT_MARKER).read_text())["files"]
    except (OSError, ValueError, KeyError):
        return False
    return bool(files) and all((checkpoint / name).is_file() and (checkpoint / name).stat().st_size == size
                               for name, size in files.items())


def checkpoints(output_dir: Path) -> list[Path]:
    """Every checkpoint-N folder, oldest first."""
    if not output_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in output_dir.iterdir() if p.is_dir() and (m := CHECKPOINT.match(p.name))]
    return [p for _, p in sorted(found)]


def last_complete_checkpoint(output_dir: Path) -> Path | None:
    complete = [p for p in checkpoints(output_dir) if is_complete(p)]
    return complete[-1] if complete else None
