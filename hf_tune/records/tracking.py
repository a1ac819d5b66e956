"""The trackers of a run, through Trainer's own ``report_to`` integrations and the tracker table
(``hf_tune.catalog.trackers``): each tracker the recipe reports to is configured from the recipe's ``tracking``
section for this run only, opened where hf_tune opens it, closed when the run ends, and given the recipe as its run's
config."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

from transformers import TrainerCallback

from hf_tune.catalog.trackers import Tracker, reported, tracker_environment
from hf_tune.errors import EXIT_PREEMPTED
from hf_tune.recipe.schema import Recipe
from hf_tune.redaction import redact_secrets

TRACKER_ENV = tracker_environment()


def recipe_trackers(recipe: Recipe) -> list[Tracker]:
    """The table's entries of the recipe's ``training.report_to``."""
    return reported(recipe.training.get("report_to"))


@contextlib.contextmanager
def tracking_scope(recipe: Recipe, run_dir: Path, trainer=None, datasets: dict | None = None):
    """The trackers' settings for this run only: set on entry (what the environment already held wins), and on exit
    the environment is as it was. So a second run in one process (a notebook, the folds of ``hf-tune cv``) gets its
    own W&B / MLflow run, not the first one's id, name and folder. The tracker runs this run opened are closed, and
    ``trainer`` stops reporting to them (its later ``evaluate()`` returns metrics without logging them); a run the
    user had open before is left open. ``datasets``: what the lineage describes (default: the trainer's train and
    eval datasets)."""
    saved = {key: os.environ.get(key) for key in TRACKER_ENV}
    trackers = recipe_trackers(recipe)
    # the runs the user had open: left open, and not opened again
    ours = [t for t in trackers if not (t.active_run and t.function("active_run")() is not None)]
    handles, status = {}, "FAILED"  # MLflow's words for how the run ended
    try:
        configure_tracking(recipe, run_dir)
        main = trainer.is_world_process_zero() if trainer is not None else int(os.environ.get("RANK", "0")) == 0
        if main and any(t.open_run for t in ours) and datasets is None:
            datasets = {"train": trainer.train_dataset, "eval": trainer.eval_dataset} if trainer is not None else {}
        for tracker in ours:
            if main and tracker.open_run:
                handles[tracker.name] = tracker.function("open_run")(
                    recipe, run_dir, trainer.args if trainer is not None else None, datasets)
        yield
        status = "FINISHED"
    except BaseException as err:  # a run stopped by a signal (trainer/preemption.py) is not failed: MLflow's KILLED
        status = "KILLED" if getattr(err, "exit_code", None) == EXIT_PREEMPTED else "FAILED"
        raise
    finally:
        for tracker in ours:
            if tracker.close_run and tracker.package in sys.modules:  # a tracker never imported opened nothing
                tracker.function("close_run")(run_dir, handles.get(tracker.name), status)
                if trainer is not None and tracker.callback:
                    trainer.remove_callback(tracker.function("callback"))
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def configure_tracking(recipe: Recipe, run_dir: Path) -> None:
    """Set the trackers' environment before Trainer starts them (every rank; only the main process logs). Use it
    through ``tracking_scope``, which restores the environment afterwards."""
    for tracker in recipe_trackers(recipe):
        if tracker.configure:
            tracker.function("configure")(recipe, run_dir)


def check_trackers(recipe: Recipe) -> None:
    """Each reported tracker's own check: a setting that cannot work stops the run before anything is written."""
    for tracker in recipe_trackers(recipe):
        if tracker.check:
            tracker.function("check")()


class RecipeToTrackers(TrainerCallback):
    """Logs the resolved recipe (secrets removed) as the tracker run's config, beside Trainer's arguments."""

    def __init__(self, recipe: Recipe):
        self.recipe = redact_secrets(recipe.to_dict())
        self.trackers = [t for t in recipe_trackers(recipe) if t.recipe_config]

    def on_train_begin(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        for tracker in self.trackers:
            if tracker.package in sys.modules:  # imported by Trainer's callback where it logs
                tracker.function("recipe_config")(self.recipe)
