"""MLflow, an entry of the tracker table (``hf_tune.catalog.trackers``). The MLflow run of a run folder: hf_tune opens
it itself (name, tags, the flattened recipe and lineage as params, one run per run folder and tracking URI across
resumes), so that Trainer's ``MLflowCallback`` logs its metrics into it; the default store is SQLite in the run folder.
MLflow itself is imported only where a run uses it."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

from hf_tune import run_folder
from hf_tune.catalog.trackers import TRACKERS
from hf_tune.recipe.schema import Recipe
from hf_tune.records.lineage import flat_lineage, run_lineage
from hf_tune.redaction import redact_urls, url_has_credentials

logger = logging.getLogger(__name__)

MLFLOW = TRACKERS["mlflow"]
STORE_DB, STORE_ARTIFACTS = "mlflow.db", "artifacts"  # in the run folder's MLFLOW.logs: the default store (SQLite)


def configure_mlflow(recipe: Recipe, run_dir: Path) -> None:
    """The store (default: the run folder's own) and the experiment (``tracking.project``), where the environment
    does not already say; a URI with a password keeps MLflow from printing its run links whole."""
    if "MLFLOW_TRACKING_URI" not in os.environ:
        os.environ["MLFLOW_TRACKING_URI"] = run_folder_mlflow_uri(run_dir)
        (run_dir / MLFLOW.logs).mkdir(parents=True, exist_ok=True)
    if recipe.tracking.project:
        os.environ.setdefault("MLFLOW_EXPERIMENT_NAME", recipe.tracking.project)
    if url_has_credentials(os.environ["MLFLOW_TRACKING_URI"]):  # MLflow prints its run links to stdout whole
        os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")


def active_mlflow_run():
    """MLflow's active run in this process (MLflow itself not imported if nothing imported it)."""
    mlflow = sys.modules.get("mlflow")
    return mlflow.active_run() if mlflow is not None else None


def close_mlflow_run(run_dir: Path, run_id: str | None, status: str) -> None:
    """The run folder's description into the run hf_tune opened (``run_id``), then the active run ended with
    ``status`` once Trainer's asynchronous metric logging is flushed."""
    import mlflow

    if run_id is not None:
        log_run_folder_artifacts(run_dir, run_id)
    if mlflow.active_run() is not None:
        mlflow.flush_async_logging()
        mlflow.end_run(status)


def mlflow_samples(args, rows: list[dict], path: Path, step: int) -> None:
    """The samples file so far (every evaluation's samples) as an artifact of the active run."""
    import mlflow

    if mlflow.active_run() is not None:
        mlflow.log_artifact(str(path))


def run_folder_mlflow_uri(run_dir: Path) -> str:
    """The default MLflow store: SQLite in ``run_dir/mlruns`` (MLflow 3 refuses a plain file store unless
    ``MLFLOW_ALLOW_FILE_STORE=true``), artifacts beside it."""
    return f"sqlite:///{(run_dir / MLFLOW.logs / STORE_DB).resolve()}"


def start_mlflow_run(recipe: Recipe, run_dir: Path, args=None, datasets: dict | None = None) -> str:
    """Open this run folder's MLflow run as the active run (main process only), so that Trainer's ``MLflowCallback``
    logs into it instead of starting one named by ``args.run_name`` alone: the recipe's ``tracking`` name and tags
    reach MLflow, the params are the flattened recipe and lineage (``hf_tune.records.lineage``), and a resumed run
    (its id is kept in ``run_dir/mlflow_run_id``, per tracking URI) continues the same MLflow run. The store is
    ``MLFLOW_TRACKING_URI`` (default: ``run_dir/mlruns``), the experiment ``MLFLOW_EXPERIMENT_NAME`` (default:
    ``tracking.project``, else MLflow's default experiment). Returns the run id."""
    import mlflow
    from mlflow import MlflowClient

    uri = mlflow.get_tracking_uri()  # a URI set in this process (mlflow.set_tracking_uri) wins, as in MLflow
    client = MlflowClient(uri)
    tracking = recipe.tracking
    name = tracking.name or (args.run_name if args is not None else None) or run_dir.name
    tags = {"hf_tune.run_dir": str(run_dir.resolve())}
    if tracking.group:
        tags["group"] = tracking.group
    for tag in tracking.tags:  # "key=value" is a key and a value; a bare word is a key with no value
        key, _, value = tag.partition("=")
        tags[key] = value
    run_id = existing_mlflow_run(client, run_dir, uri)
    if run_id is None:
        run_id = client.create_run(mlflow_experiment_id(client, run_dir, uri), run_name=name, tags=tags).info.run_id
        save_mlflow_run_id(run_dir, uri, run_id)
    else:
        logger.info("MLflow: continuing run %s of %s", run_id, uri)
        client.update_run(run_id, status="RUNNING", name=name)
        for key, value in tags.items():
            client.set_tag(run_id, key, value)
    log_new_params(client, run_id, flat_lineage(run_lineage(recipe, datasets or {})))
    mlflow.start_run(run_id=run_id)
    if uri.startswith(("http://", "https://")) and os.environ.get("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"):
        experiment = client.get_run(run_id).info.experiment_id  # MLflow's own link would print the password
        logger.info("MLflow: run at %s", redact_urls(f"{uri.rstrip('/')}/#/experiments/{experiment}/runs/{run_id}"))
    return run_id


def mlflow_experiment_id(client, run_dir: Path, uri: str, name: str | None = None) -> str:
    """The experiment ``name`` (default: ``MLFLOW_EXPERIMENT_NAME``), created where missing; else MLflow's Default
    one. In the run folder's own store the default is "hf_tune", keeping its artifacts in the run folder (Default's
    are in the working directory)."""
    from mlflow.exceptions import MlflowException

    own_store = uri == run_folder_mlflow_uri(run_dir)
    name = name or os.environ.get("MLFLOW_EXPERIMENT_NAME") or ("hf_tune" if own_store else None)
    if not name:
        return "0"
    found = client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    artifacts = run_dir / MLFLOW.logs / STORE_ARTIFACTS
    artifacts = artifacts.resolve().as_uri() if own_store else None
    try:
        return client.create_experiment(name, artifact_location=artifacts)
    except MlflowException:  # created meanwhile by another process
        return client.get_experiment_by_name(name).experiment_id


def existing_mlflow_run(client, run_dir: Path, uri: str) -> str | None:
    """The MLflow run this run folder already logged to in this store, if it still exists there."""
    from mlflow.exceptions import MlflowException

    try:
        run_id = json.loads((run_dir / MLFLOW.run_id_file).read_text()).get(redact_urls(uri))
    except (OSError, ValueError):
        return None
    if run_id is None:
        return None
    try:
        return run_id if client.get_run(run_id).info.lifecycle_stage == "active" else None
    except MlflowException:
        return None


def save_mlflow_run_id(run_dir: Path, uri: str, run_id: str) -> None:
    path = run_dir / MLFLOW.run_id_file
    try:
        ids = json.loads(path.read_text())
    except (OSError, ValueError):
        ids = {}
    run_dir.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.tmp")
    staging.write_text(json.dumps({**ids, redact_urls(uri): run_id}, indent=2))  # a URI's password never written
    os.replace(staging, path)


def log_new_params(client, run_id: str, params: dict[str, str]) -> None:
    """Log the params the run lacks. MLflow params never change: a resumed run whose recipe or lineage differs keeps
    its first values and gets the new ones as ``changed_on_resume.KEY`` tags."""
    from mlflow.entities import Param, RunTag
    from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

    params = {key: value if len(value) <= MAX_PARAM_VAL_LENGTH else value[:MAX_PARAM_VAL_LENGTH - 1] + "…"
              for key, value in params.items()}
    logged = client.get_run(run_id).data.params
    new = [Param(key, value) for key, value in params.items() if key not in logged]
    changed = [RunTag(f"changed_on_resume.{key}", value) for key, value in params.items()
               if key in logged and logged[key] != value]
    for batch in (new, changed):
        for i in range(0, len(batch), MAX_PARAMS_TAGS_PER_BATCH):
            if batch is new:
                client.log_batch(run_id, params=batch[i:i + MAX_PARAMS_TAGS_PER_BATCH])
            else:
                client.log_batch(run_id, tags=batch[i:i + MAX_PARAMS_TAGS_PER_BATCH])
    if changed:
        logger.warning("MLflow: the resumed run's %s differ from its first params; MLflow keeps the first values, the "
                       "new ones are tags changed_on_resume.*", ", ".join(t.key.partition(".")[2] for t in changed))


def log_run_folder_artifacts(run_dir: Path, run_id: str) -> None:
    """The run folder's description into the MLflow run: recipe.yaml, run.json and the plots, where written."""
    from mlflow import MlflowClient

    client = MlflowClient()
    for name in (run_folder.RECIPE, run_folder.MANIFEST, run_folder.LOSS_PLOT, run_folder.LR_PLOT,
                 run_folder.EVAL_METRICS_PLOT):
        if (run_dir / name).is_file():
            client.log_artifact(run_id, str(run_dir / name))
