"""The tracker table: every experiment tracker ``training.report_to`` may name, with the extra that installs it, the
environment hf_tune sets for a run, its files in the run folder, and how hf_tune opens, continues, closes and feeds a
run of it. Trainer's own integration of the same name logs the metrics; an entry adds what it lacks: one tracker run
per run folder across resumes, the recipe as the run's config, the evaluation's samples, a refusal before the run of a
setting that cannot work.

A new tracker is one entry here plus the module of the functions it names (``hf_tune.records.<name>_run``); the
rest of hf_tune loops over the table. Pure: the functions are ``module:function`` paths, imported when first called.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from hf_tune.catalog.late_bound import resolve


@dataclasses.dataclass(frozen=True)
class Tracker:
    name: str  # its training.report_to value: Trainer's integration of that name logs the metrics
    package: str  # the module it imports (checked before the run)
    extra: str  # hf_tune's extra that installs it
    environment: tuple[str, ...] = ()  # the variables `configure` may set: restored after each run of a process
    logs: str | None = None  # its folder in the run folder (`hf-tune push --include-logs` uploads it)
    run_id_file: str | None = None  # in the run folder: the tracker run it continues on resume (the mirror keeps it)
    # "module:function" paths, each optional:
    check: str | None = None  # (): refuses a setting that cannot work, before anything is written
    configure: str | None = None  # (recipe, run_dir): its environment, before Trainer starts it (every rank)
    active_run: str | None = None  # (): the run open in this process (a user's own is left open), None if none
    open_run: str | None = None  # (recipe, run_dir, args, datasets) -> handle: hf_tune opens the run (main process)
    close_run: str | None = None  # (run_dir, handle, status): closes the run this run opened; status: MLflow's word
    recipe_config: str | None = None  # (recipe as a dict, secrets removed): the recipe as the run's config
    samples: str | None = None  # (args, rows, path, step): an evaluation's generation samples
    callback: str | None = None  # "module:Class" of Trainer's callback, dropped from the trainer once its run closes

    def function(self, field: str) -> Callable | None:
        """The function (or class) of ``field``, imported now; None where the entry has none."""
        dotted = getattr(self, field)
        if dotted is None:
            return None
        return resolve(dotted)


TRACKERS = {
    "wandb": Tracker(
        "wandb", "wandb", "wandb", logs="wandb", run_id_file="wandb_run_id",
        environment=("WANDB_PROJECT", "WANDB_RUN_GROUP", "WANDB_TAGS", "WANDB_NAME", "WANDB_DIR", "WANDB_RUN_ID",
                     "WANDB_RESUME", "WANDB_MODE"),
        check="hf_tune.records.wandb_run:check_explicit_wandb_online",
        configure="hf_tune.records.wandb_run:configure_wandb",
        active_run="hf_tune.records.wandb_run:active_wandb_run",
        close_run="hf_tune.records.wandb_run:close_wandb_run",
        recipe_config="hf_tune.records.wandb_run:wandb_recipe_config",
        samples="hf_tune.records.wandb_run:wandb_samples",
        callback="transformers.integrations:WandbCallback"),
    "mlflow": Tracker(
        "mlflow", "mlflow", "mlflow", logs="mlruns", run_id_file="mlflow_run_id",
        environment=("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"),
        configure="hf_tune.records.mlflow_run:configure_mlflow",
        active_run="hf_tune.records.mlflow_run:active_mlflow_run",
        open_run="hf_tune.records.mlflow_run:start_mlflow_run",
        close_run="hf_tune.records.mlflow_run:close_mlflow_run",
        samples="hf_tune.records.mlflow_run:mlflow_samples",
        callback="transformers.integrations:MLflowCallback"),
    "tensorboard": Tracker("tensorboard", "tensorboard", "tensorboard", logs="runs",
                           samples="hf_tune.records.tensorboard_run:tensorboard_samples"),
    # Trackio (local-first) takes the run's name and project from Trainer's own arguments: nothing more to add
    "trackio": Tracker("trackio", "trackio", "trackio"),
}


def reported(targets: str | list[str] | None) -> list[Tracker]:
    """The entries of a ``report_to`` value (a name, a list, "all", "none" or None); "all" names every entry."""
    names = [targets] if isinstance(targets, str) else list(targets or [])
    return [tracker for tracker in TRACKERS.values() if tracker.name in names or "all" in names]


def tracker_environment() -> tuple[str, ...]:
    """Every variable a tracker's ``configure`` may set."""
    return tuple(key for tracker in TRACKERS.values() for key in tracker.environment)


def tracker_files(field: str) -> tuple[str, ...]:
    """Each entry's ``logs`` or ``run_id_file``, where it has one."""
    return tuple(getattr(tracker, field) for tracker in TRACKERS.values() if getattr(tracker, field))
