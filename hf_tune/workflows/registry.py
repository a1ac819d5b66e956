"""The MLflow model registry: ``hf-tune register RUN --name NAME [--alias staging]`` logs a run's trained model (a
full fine-tune as is, a LoRA run merged into its base) with MLflow's transformers flavor, its signature and the
run's lineage, and registers a new version; ``hf-tune promote NAME VERSION --alias production`` moves an alias
(MLflow's aliases replace the old stages). ``models:/NAME@production`` then loads that version."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Any

import yaml

from hf_tune import run_folder
from hf_tune.errors import HfTuneError
from hf_tune.records.lineage import flat_lineage, read_lineage
from hf_tune.records.mlflow_run import (
    existing_mlflow_run,
    log_new_params,
    log_run_folder_artifacts,
    mlflow_experiment_id,
    run_folder_mlflow_uri,
    save_mlflow_run_id,
)
from hf_tune.records.run_reader import open_run
from hf_tune.workflows.merge_run import merge, run_task


def registry_uri(run_dir: str | Path | None = None, tracking_uri: str | None = None) -> str:
    """The MLflow store: the one given, else ``MLFLOW_TRACKING_URI``, else the run folder's own store."""
    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    if run_dir is None:
        raise HfTuneError("no MLflow tracking URI\n  fix: set MLFLOW_TRACKING_URI or pass --tracking-uri")
    return run_folder_mlflow_uri(Path(run_dir))


def refuse_a_missing_store(uri: str) -> None:
    """A local store (``sqlite:///FILE``, a folder or ``file://`` path) that does not exist is a mistyped path:
    MLflow would create an empty store there, and ``promote`` reads a registry, it never starts one."""
    from urllib.parse import urlparse

    parsed = urlparse(uri)
    if parsed.scheme == "sqlite":  # sqlite:///relative.db, sqlite:////absolute.db
        local = Path(uri.removeprefix("sqlite:///"))
    elif parsed.scheme in ("", "file"):
        local = Path(parsed.path if parsed.scheme == "file" else uri)
    else:
        return  # a server: it answers for itself
    if not local.exists():
        raise HfTuneError(f"--tracking-uri {uri}: {local} does not exist, so it holds no registered model\n  fix: "
                          "name the store `hf-tune register` wrote to (a run folder's is RUN_DIR/mlruns/mlflow.db)")


@contextlib.contextmanager
def _using(uri: str):
    """MLflow's tracking URI for the calls inside; the process's own one afterwards. Unset, not set again: a URI
    set in the process outranks MLFLOW_TRACKING_URI, so setting the one before would pin it for every later run of
    the process (a notebook's next ``train`` would log to the registry's store, not its run folder's)."""
    import mlflow

    before = os.environ.get("MLFLOW_TRACKING_URI")  # mlflow.set_tracking_uri mirrors its URI into this variable
    mlflow.set_tracking_uri(uri)
    try:
        yield
    finally:
        mlflow.set_tracking_uri(None)  # unsets the variable too
        if before is not None:
            os.environ["MLFLOW_TRACKING_URI"] = before


def register(run_dir: str | Path, name: str, alias: str | None = None, tracking_uri: str | None = None) -> dict:
    """Log the run's model into its MLflow run (the one it trained in, from ``RUN_DIR/mlflow_run_id``, else a new run
    carrying its lineage as params), register it as a new version of ``name`` tagged with the same lineage fields,
    and point ``alias`` at it. Returns the version, its ``models:/`` URI and the MLflow run id."""
    run_dir = open_run(run_dir, needs=("manifest", "recipe", "weights", "tokenizer")).path
    mlflow = _mlflow()
    from mlflow import MlflowClient

    uri = registry_uri(run_dir, tracking_uri)
    lineage = read_lineage(run_dir)
    flat = flat_lineage(lineage)
    with _using(uri), tempfile.TemporaryDirectory() as scratch:
        client = MlflowClient(uri)
        run_id = existing_mlflow_run(client, run_dir, uri)
        if run_id is None:
            project = os.environ.get("MLFLOW_EXPERIMENT_NAME") or (lineage["recipe"] or {}).get("tracking", {}).get(
                "project")
            experiment = mlflow_experiment_id(client, run_dir, uri, project)
            run_id = client.create_run(experiment, run_name=run_dir.name,
                                       tags={"hf_tune.run_dir": str(run_dir.resolve())}).info.run_id
            save_mlflow_run_id(run_dir, uri, run_id)
            log_new_params(client, run_id, flat)
            log_run_folder_artifacts(run_dir, run_id)
            client.set_terminated(run_id)
        model, tokenizer, task = _trained_model(run_dir, Path(scratch))
        packages = lineage.get("packages") or {}
        requirements = [f"{p}=={packages[p]}" for p in ("torch", "transformers", "peft")
                        if packages.get(p) and packages[p] != "not installed"]
        with mlflow.start_run(run_id=run_id):
            info = mlflow.transformers.log_model(
                {"model": model, "tokenizer": tokenizer}, name="model", task=task.pipeline_tag,
                registered_model_name=name, pip_requirements=requirements,
                metadata={"hf_tune_lineage": {k: v for k, v in lineage.items() if k != "recipe"}})
        version = str(info.registered_model_version)
        for key, value in {**flat, "hf_tune.run_dir": str(run_dir.resolve())}.items():
            client.set_model_version_tag(name, version, key, value[:5000])
        client.update_model_version(name, version, description=_description(run_dir, lineage))
        if alias:
            client.set_registered_model_alias(name, alias, version)
    return {"name": name, "version": version, "model_uri": f"models:/{name}/{version}", "run_id": run_id,
            "alias": alias, "tracking_uri": uri}


def promote(name: str, version: str | int, alias: str, tracking_uri: str | None = None) -> dict:
    """Point ``alias`` of registered model ``name`` at ``version``; returns the version it pointed at before."""
    _mlflow()
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    uri = registry_uri(None, tracking_uri)
    refuse_a_missing_store(uri)
    client = MlflowClient(uri)
    try:
        client.get_model_version(name, str(version))
    except MlflowException as err:
        raise HfTuneError(f"{name} has no version {version}: {err.message}\n  fix: `hf-tune register RUN --name "
                          f"{name}` first, or name an existing version") from None
    try:
        previous = client.get_model_version_by_alias(name, alias).version
    except MlflowException:
        previous = None
    client.set_registered_model_alias(name, alias, str(version))
    return {"name": name, "alias": alias, "version": str(version), "previous": previous}


def _mlflow():
    try:
        import mlflow
        import mlflow.transformers  # noqa: F401
    except ImportError:
        raise HfTuneError("the model registry needs MLflow\n  fix: pip install 'hf_tune[mlflow]'") from None
    return mlflow


def _trained_model(run_dir: Path, scratch: Path) -> tuple[Any, Any, Any]:
    """(model, tokenizer, task) of a run: its full model, or its LoRA adapter merged into the base (float32)."""
    from transformers import AutoTokenizer

    task = run_task(run_dir)
    source = run_dir
    if (run_dir / run_folder.ADAPTER_CONFIG).is_file():
        source = Path(merge(run_dir, out=scratch / "merged", dtype="float32")["merged_dir"])
    elif not (run_dir / run_folder.MODEL_CONFIG).is_file():
        raise HfTuneError(f"{run_dir}: no adapter or model saved here\n  fix: pass the output_dir of a finished run")
    return task.model_class.from_pretrained(source).eval(), AutoTokenizer.from_pretrained(source), task


def _description(run_dir: Path, lineage: dict) -> str:
    base, git = lineage.get("base_model") or {}, lineage.get("git") or {}
    recipe = yaml.safe_dump(lineage.get("recipe") or {}, sort_keys=False)
    return (f"hf_tune run {run_dir.resolve()}; base model {base.get('hub_id') or base.get('name_or_path')}; "
            f"git {git.get('commit')}{' (dirty)' if git.get('dirty') else ''}\n\nrecipe:\n{recipe}")[:5000]
