"""Experiment trackers through Trainer's own ``report_to`` integrations, configured from the recipe's ``tracking``
section: W&B falls back to offline mode instead of crashing, keeps one run across resumes; MLflow defaults to a file
store in the run folder."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import uuid
from pathlib import Path

from transformers import TrainerCallback

from hf_tune.recipe.loading import Recipe, redact_secrets

logger = logging.getLogger(__name__)


def report_targets(recipe: Recipe) -> list[str]:
    targets = recipe.training.get("report_to", "none")
    targets = [targets] if isinstance(targets, str) else list(targets or [])
    return [] if targets in (["none"], []) else targets


def wandb_can_sync(timeout: float = 3.0) -> tuple[bool, str]:
    if not (os.environ.get("WANDB_API_KEY") or _netrc_has("api.wandb.ai")):
        return False, "no W&B API key"
    try:
        socket.create_connection(("api.wandb.ai", 443), timeout=timeout).close()
        return True, ""
    except OSError:
        return False, "W&B is unreachable"


def _netrc_has(host: str) -> bool:
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    return netrc.is_file() and host in netrc.read_text(errors="ignore")


TRACKER_ENV = ("WANDB_PROJECT", "WANDB_RUN_GROUP", "WANDB_TAGS", "WANDB_NAME", "WANDB_DIR", "WANDB_RUN_ID",
               "WANDB_RESUME", "WANDB_MODE", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_RUN_NAME")


@contextlib.contextmanager
def tracking_scope(recipe: Recipe, run_dir: Path):
    """The trackers' settings for this run only: set on entry (what the environment already held wins), and on exit
    the tracker runs are closed and the environment is as it was. So a second run in one process (a notebook, the
    folds of ``hf-tune cv``) gets its own W&B / MLflow run, not the first one's id, name and folder."""
    saved = {key: os.environ.get(key) for key in TRACKER_ENV}
    try:
        configure_tracking(recipe, run_dir)
        yield
    finally:
        _finish_tracker_runs()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _finish_tracker_runs() -> None:
    if "wandb" in sys.modules:
        wandb = sys.modules["wandb"]
        if wandb.run is not None:
            wandb.finish()
        wandb.teardown()  # W&B reads WANDB_* once per process setup: the next run must set up anew
    if "mlflow" in sys.modules and sys.modules["mlflow"].active_run() is not None:
        sys.modules["mlflow"].end_run()


def configure_tracking(recipe: Recipe, run_dir: Path) -> None:
    """Set the trackers' environment before Trainer starts them (every rank; only the main process logs). Use it
    through ``tracking_scope``, which restores the environment afterwards."""
    targets, tracking = report_targets(recipe), recipe.tracking
    if "wandb" in targets or "all" in targets:
        env = {"WANDB_PROJECT": tracking.project, "WANDB_RUN_GROUP": tracking.group,
               "WANDB_TAGS": ",".join(tracking.tags) if tracking.tags else None, "WANDB_NAME": tracking.name,
               "WANDB_DIR": str(run_dir)}
        for key, value in env.items():
            if value and key not in os.environ:
                os.environ[key] = value
        os.environ.setdefault("WANDB_RUN_ID", wandb_run_id(run_dir))
        os.environ.setdefault("WANDB_RESUME", "allow")
        if os.environ.get("WANDB_MODE") not in ("offline", "disabled"):
            online, why = wandb_can_sync()
            if not online:
                os.environ["WANDB_MODE"] = "offline"
                logger.warning("W&B: %s, so this run logs offline under %s/wandb; sync it later with "
                               "`wandb sync %s/wandb/offline-run-*`", why, run_dir, run_dir)
    if "mlflow" in targets or "all" in targets:
        os.environ.setdefault("MLFLOW_TRACKING_URI", (run_dir / "mlruns").resolve().as_uri())
        if tracking.project:
            os.environ.setdefault("MLFLOW_EXPERIMENT_NAME", tracking.project)
        if tracking.name:
            os.environ.setdefault("MLFLOW_RUN_NAME", tracking.name)


def wandb_run_id(run_dir: Path) -> str:
    """One W&B run per run folder, kept in ``run_dir/wandb_run_id``: a resumed run continues it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    id_file = run_dir / "wandb_run_id"
    if not id_file.is_file():
        # every rank gets here at once: the first id linked into place wins, and no rank reads a half-written file
        staged = id_file.with_name(f".wandb_run_id.{os.getpid()}")
        staged.write_text(uuid.uuid4().hex[:12])
        try:
            os.link(staged, id_file)
        except FileExistsError:
            pass
        finally:
            staged.unlink()
    return id_file.read_text().strip()


class RecipeToTrackers(TrainerCallback):
    """Logs the resolved recipe (secrets removed) as the tracker run's config, beside Trainer's arguments."""

    def __init__(self, recipe: Recipe):
        self.recipe = redact_secrets(recipe.to_dict())

    def on_train_begin(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        try:
            import wandb
        except ImportError:
            return
        if wandb.run is not None:
            wandb.config.update({"hf_tune_recipe": self.recipe}, allow_val_change=True)
