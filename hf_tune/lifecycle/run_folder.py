"""Every file name of a run folder (``training.output_dir``) and of a search's study folder, named once here."""

from __future__ import annotations

import re

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
WANDB_RUN_ID = "wandb_run_id"  # one W&B run per run folder, continued on resume
MLFLOW_RUN_ID = "mlflow_run_id"  # one MLflow run per run folder and tracking URI, continued on resume
MLFLOW_DB, MLFLOW_ARTIFACTS = "mlflow.db", "artifacts"  # in MLFLOW_DIR: the default MLflow store (SQLite)
WANDB_DIR, MLFLOW_DIR, TENSORBOARD_DIR = "wandb", "mlruns", "runs"  # tracker logs
CV_RESULTS = "cv_results.json"  # hf-tune cv
SAMPLES = "samples.jsonl"  # evaluation.samples: one line per prompt per evaluation (step, prompt, completion)
WATCHED_SCORES = "eval_scores.jsonl"  # hf-tune eval: one line per scored checkpoint (step, checkpoint, scores)
PROFILE_DIR = "profile"  # the recipe's profile section, or hf-tune profile: torch.profiler's outputs, in it:
PROFILE_TRACE, PROFILE_TOP_OPS, PROFILE_SUMMARY = "trace.json", "top_ops.csv", "profile.json"
STUDY_DB, TRIALS_CSV, BEST_RECIPE = "study.db", "trials.csv", "best_recipe.yaml"  # a search's study folder
