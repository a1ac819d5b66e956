"""Experiment trackers through Trainer's own ``report_to`` integrations, configured from the recipe's ``tracking``
section: W&B falls back to offline mode instead of crashing, keeps one run across resumes; MLflow defaults to a file
store in the run folder, and hf_tune opens the MLflow run itself (``hf_tune.lifecycle.mlflow_run``) so that Trainer's
``MLflowCallback`` logs its metrics into it."""

from __future__ import annotations

import configparser
import contextlib
import functools
import logging
import netrc
import os
import sys
import uuid
from pathlib import Path
from urllib.parse import urlsplit

from transformers import TrainerCallback

from hf_tune.lifecycle import run_folder
from hf_tune.errors import EXIT_PREEMPTED, RecipeError
from hf_tune.lifecycle.mlflow_run import log_run_folder_artifacts, run_folder_mlflow_uri, start_mlflow_run
from hf_tune.recipe.schema import Recipe
from hf_tune.redaction import redact_secrets, url_has_credentials

logger = logging.getLogger(__name__)


def report_targets(recipe: Recipe) -> list[str]:
    targets = recipe.training.get("report_to", "none")
    targets = [targets] if isinstance(targets, str) else list(targets or [])
    return [] if targets in (["none"], []) else targets


WANDB_CLOUD = "https://api.wandb.ai"


def wandb_can_sync(timeout: float = 3.0) -> tuple[bool, str]:
    """(can a W&B run log online, why not): the W&B server the run would log to (``wandb_base_url``) has an API key
    here and answers a request made as W&B's own client makes it, through the environment's proxies.
    ``WANDB_MODE=offline`` or ``disabled`` decides without asking."""
    mode = os.environ.get("WANDB_MODE")
    if mode in ("offline", "disabled", "dryrun"):
        return False, f"WANDB_MODE={mode}"
    url = wandb_base_url()
    if not (os.environ.get("WANDB_API_KEY") or _netrc_has(urlsplit(url).netloc)):
        return False, f"no W&B API key for {url} (WANDB_API_KEY, or `wandb login --host {url}`)"
    if not server_answers(url, timeout):
        return False, f"the W&B server {url} does not answer"
    return True, ""


def wandb_base_url() -> str:
    """The W&B server runs log to, found where W&B looks: ``WANDB_BASE_URL``, then the ``base_url`` that
    `wandb login --host` saved in W&B's settings file, then the public cloud."""
    if url := os.environ.get("WANDB_BASE_URL"):
        return url.rstrip("/")
    settings = configparser.ConfigParser()
    settings.read(Path(os.environ.get("WANDB_CONFIG_DIR", Path.home() / ".config" / "wandb")) / "settings")
    return settings.get("default", "base_url", fallback=WANDB_CLOUD).rstrip("/")


@functools.cache
def server_answers(url: str, timeout: float = 3.0) -> bool:
    """One HEAD request with `requests`, the HTTP library of W&B's Python client: it honours ``HTTPS_PROXY``,
    ``HTTP_PROXY`` and ``NO_PROXY``. Cached per URL, so the runs of a search or a cv do not each wait on a server
    that is down. A 5xx (a proxy that cannot reach the server, or the server itself failing) counts as no answer."""
    import requests

    try:
        return requests.head(url, timeout=timeout, allow_redirects=True).status_code < 500
    except requests.RequestException:
        return False


def _netrc_has(host: str) -> bool:
    """Whether the netrc file (``NETRC``, else ~/.netrc) holds a password for ``host`` (host[:port], as W&B keys it)."""
    path = Path(os.environ.get("NETRC", Path.home() / ".netrc")).expanduser()
    try:
        return netrc.netrc(path).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


TRACKER_ENV = ("WANDB_PROJECT", "WANDB_RUN_GROUP", "WANDB_TAGS", "WANDB_NAME", "WANDB_DIR", "WANDB_RUN_ID",
               "WANDB_RESUME", "WANDB_MODE", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME",
               "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT")


@contextlib.contextmanager
def tracking_scope(recipe: Recipe, run_dir: Path, trainer=None, datasets: dict | None = None):
    """The trackers' settings for this run only: set on entry (what the environment already held wins), and on exit
    the environment is as it was. So a second run in one process (a notebook, the folds of ``hf-tune cv``) gets its
    own W&B / MLflow run, not the first one's id, name and folder. The tracker runs this run opened are closed, and
    ``trainer`` stops reporting to them (its later ``evaluate()`` returns metrics without logging them); a run the
    user had open before is left open. ``datasets``: what the lineage describes (default: the trainer's train and
    eval datasets)."""
    saved = {key: os.environ.get(key) for key in TRACKER_ENV}
    before = _open_tracker_runs()
    status, mlflow_run_id = "FAILED", None  # MLflow's name for how the run ended
    try:
        configure_tracking(recipe, run_dir)
        main = trainer.is_world_process_zero() if trainer is not None else int(os.environ.get("RANK", "0")) == 0
        if main and _reports_to(recipe, "mlflow") and before["mlflow"] is None:
            if datasets is None:
                datasets = {"train": trainer.train_dataset, "eval": trainer.eval_dataset} if trainer is not None else {}
            mlflow_run_id = start_mlflow_run(recipe, run_dir, trainer.args if trainer is not None else None, datasets)
        yield
        status = "FINISHED"
    except BaseException as err:  # a run stopped by a signal (trainer/preemption.py) is not failed: MLflow's KILLED
        status = "KILLED" if getattr(err, "exit_code", None) == EXIT_PREEMPTED else "FAILED"
        raise
    finally:
        if mlflow_run_id is not None:
            log_run_folder_artifacts(run_dir, mlflow_run_id)
        closed = _finish_tracker_runs(recipe, before, status)
        if trainer is not None:
            for callback in closed:
                trainer.remove_callback(callback)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _open_tracker_runs() -> dict[str, object]:
    wandb, mlflow = sys.modules.get("wandb"), sys.modules.get("mlflow")
    return {"wandb": wandb.run if wandb is not None else None,
            "mlflow": mlflow.active_run() if mlflow is not None else None}


def _reports_to(recipe: Recipe, tracker: str) -> bool:
    targets = report_targets(recipe)
    return tracker in targets or "all" in targets


def _finish_tracker_runs(recipe: Recipe, before: dict[str, object], status: str = "FINISHED") -> list[type]:
    """Close the runs opened since ``before`` by the trackers the recipe reports to; their callback classes."""
    from transformers.integrations import MLflowCallback, WandbCallback

    closed = []
    wandb, mlflow = sys.modules.get("wandb"), sys.modules.get("mlflow")
    if _reports_to(recipe, "wandb") and wandb is not None and before["wandb"] is None:
        if wandb.run is not None:
            wandb.finish()
        wandb.teardown()  # W&B reads WANDB_* once per process setup: the next run must set up anew
        closed.append(WandbCallback)
    if _reports_to(recipe, "mlflow") and mlflow is not None and before["mlflow"] is None:
        if mlflow.active_run() is not None:
            mlflow.flush_async_logging()  # Trainer's callback logs metrics asynchronously
            mlflow.end_run(status)
        closed.append(MLflowCallback)
    return closed


def configure_tracking(recipe: Recipe, run_dir: Path) -> None:
    """Set the trackers' environment before Trainer starts them (every rank; only the main process logs). Use it
    through ``tracking_scope``, which restores the environment afterwards."""
    targets, tracking = report_targets(recipe), recipe.tracking
    if "wandb" in targets or "all" in targets:
        env = {"WANDB_PROJECT": tracking.project, "WANDB_RUN_GROUP": tracking.group,
               "WANDB_TAGS": ",".join(tracking.tags) if tracking.tags else None, "WANDB_NAME": tracking.name,
               "WANDB_DIR": str(run_dir)}
        _choose_wandb_mode(run_dir)
        for key, value in env.items():
            if value and key not in os.environ:
                os.environ[key] = value
        os.environ.setdefault("WANDB_RUN_ID", wandb_run_id(run_dir))
        os.environ.setdefault("WANDB_RESUME", "allow")
    if "mlflow" in targets or "all" in targets:
        if "MLFLOW_TRACKING_URI" not in os.environ:
            os.environ["MLFLOW_TRACKING_URI"] = run_folder_mlflow_uri(run_dir)
            (run_dir / run_folder.MLFLOW_DIR).mkdir(parents=True, exist_ok=True)
        if tracking.project:
            os.environ.setdefault("MLFLOW_EXPERIMENT_NAME", tracking.project)
        if url_has_credentials(os.environ["MLFLOW_TRACKING_URI"]):  # MLflow prints its run links to stdout whole
            os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")


WANDB_ONLINE_MODES = ("online", "run", "shared")  # WANDB_MODE values that log to the server


def _choose_wandb_mode(run_dir: Path) -> None:
    """W&B logs online when it can, else offline into the run folder (said in one warning). A ``WANDB_MODE`` the
    user set wins: an explicit online mode that cannot work stops the run here, before anything is written."""
    if os.environ.get("WANDB_MODE") in ("offline", "disabled", "dryrun"):
        return
    online, why = wandb_can_sync()
    if online:
        return
    check_explicit_wandb_online(why)
    os.environ["WANDB_MODE"] = "offline"
    logger.warning("W&B: %s, so this run logs offline under %s/wandb; sync it later with "
                   "`wandb sync %s/wandb/offline-run-*`", why, run_dir, run_dir)


def check_explicit_wandb_online(why: str | None = None) -> None:
    """An explicit ``WANDB_MODE=online`` that cannot log (no API key, no answer) is refused; ``why``: the reason
    already found, else asked now. Called when the recipe loads, and again when the run's trackers start."""
    mode = os.environ.get("WANDB_MODE")
    if mode not in WANDB_ONLINE_MODES:
        return
    if why is None:
        online, why = wandb_can_sync()
        if online:
            return
    raise RecipeError("training.report_to", f"includes wandb and WANDB_MODE={mode} is set, but {why}",
                      fix="log in (WANDB_API_KEY, or `wandb login`) on a machine that reaches the server; or unset "
                      "WANDB_MODE: hf_tune then logs offline into the run folder, for `wandb sync` later")


def wandb_run_id(run_dir: Path) -> str:
    """One W&B run per run folder, kept in ``run_dir/wandb_run_id``: a resumed run continues it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    id_file = run_dir / run_folder.WANDB_RUN_ID
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
