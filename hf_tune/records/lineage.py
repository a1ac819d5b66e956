"""A run's lineage, from one function: what it was trained from (resolved recipe, base model, data fingerprints)
and with what (package versions, git commit). ``run.json`` holds it; the tracker params, the model registry's
entry and the model card carry the same fields, read back from ``run.json`` by ``read_lineage``. Never a secret."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from hf_tune import run_folder
from hf_tune.catalog.sources import looks_like_local_path
from hf_tune.catalog.trackers import TRACKERS
from hf_tune.model.embedded import EMBEDDED_MODELS, PREFIX, EmbeddedModel
from hf_tune.recipe.schema import Recipe
from hf_tune.records.resolved_recipe import resolved_recipe_dict
from hf_tune.redaction import redact_secrets

PACKAGES = ("hf_tune", "torch", "transformers", "datasets", "accelerate", "peft", "trl", "deepspeed", "optuna",
            "evaluate", *(tracker.package for tracker in TRACKERS.values()))  # every tracker's version too
LINEAGE_FIELDS = ("recipe", "base_model", "datasets", "git", "packages")  # the keys of run_lineage, in run.json
KEY_UNSAFE = re.compile(r"[^/\w.\- :]")  # what MLflow refuses in a param or tag name (a rank_pattern regex, ...)


def run_lineage(recipe: Recipe, datasets: dict[str, Any]) -> dict[str, Any]:
    """The lineage fields of a run: ``datasets`` maps a split name to its ``datasets.Dataset`` (or None), or a
    mixture's source (``train[i]``) to what it gave (a dict: path, format, fingerprint, examples)."""
    return {
        "recipe": redact_secrets(resolved_recipe_dict(recipe)),
        "base_model": base_model(recipe.model.pretrained_model_name_or_path, recipe.model.revision),
        "datasets": {name: ds if isinstance(ds, dict) else dataset_entry(ds)
                     for name, ds in datasets.items() if ds is not None},  # a dict: a mixture's source, described
        "git": git_state(Path.cwd()),
        "packages": package_versions(),
    }


def dataset_entry(dataset: Any) -> dict[str, Any]:
    """Fingerprint and size of a dataset; a stream (``data.streaming``) has neither until it is read: None."""
    return {"fingerprint": getattr(dataset, "_fingerprint", None),
            "examples": len(dataset) if hasattr(dataset, "__len__") else None}


def read_lineage(run_dir: str | Path) -> dict[str, Any]:
    """The lineage fields of a finished (or running) run, from its ``run.json``."""
    manifest = json.loads((Path(run_dir) / run_folder.MANIFEST).read_text())
    lineage = {key: manifest.get(key) for key in LINEAGE_FIELDS}
    if lineage["base_model"] is None and lineage["recipe"]:  # a run.json written before base_model was recorded
        model = lineage["recipe"]["model"]
        lineage["base_model"] = base_model(model["pretrained_model_name_or_path"], model.get("revision"))
    return lineage


def flat_lineage(lineage: dict[str, Any]) -> dict[str, str]:
    """The lineage as ``{dotted.key: text}``: tracker params and registry tags. The recipe's sections come first and
    unprefixed (``training.learning_rate``, ``lora.r``); lists are JSON text."""
    flat: dict[str, str] = {}
    for key in LINEAGE_FIELDS:
        _flatten(lineage.get(key) or {}, "" if key == "recipe" else key, flat)
    return flat


def _flatten(value: Any, prefix: str, into: dict[str, str]) -> None:
    if isinstance(value, dict) and value:
        for key, item in value.items():
            key = KEY_UNSAFE.sub("_", str(key).replace("[", ".").replace("]", ""))  # train[0] -> train.0
            _flatten(item, f"{prefix}.{key}" if prefix else key, into)
    elif prefix:
        into[prefix] = value if isinstance(value, str) else json.dumps(value, default=str)


def base_model(name: str, revision: str | None = None) -> dict[str, Any]:
    """Which weights a run started from: the name as the recipe gives it, its Hub id where there is one, the
    revision; for an embedded GGUF model, the file and its sha256."""
    found = {"name_or_path": name, "hub_id": base_model_id(name), "revision": revision}
    spec = embedded_spec(name) if name.startswith(PREFIX) else None
    if spec is not None:
        found["package"] = f"{spec.distribution} {package_version(spec.distribution)}"
        if spec.gguf_file:
            found.update(gguf_file=spec.gguf_file, gguf_sha256=spec.gguf_sha256)
    return {k: v for k, v in found.items() if v is not None}


def base_model_id(name: str) -> str | None:
    """The Hub id of the base model, where there is one (embedded models map to theirs; local folders have none)."""
    if name.startswith(PREFIX):
        return spec.hub_id if (spec := embedded_spec(name)) else None
    return None if looks_like_local_path(name) else name


def embedded_spec(name: str) -> EmbeddedModel | None:
    wanted = name.removeprefix(PREFIX).lower()
    return next((m for key, m in EMBEDDED_MODELS.items() if key.lower() == wanted), None)


def package_versions() -> dict[str, str]:
    versions = {"python": sys.version.split()[0]}
    for name in PACKAGES:
        versions[name] = package_version(name)
    return versions


def package_version(name: str, missing: str = "not installed") -> str:
    """The installed version of a distribution, ``missing`` when it is not installed."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return missing


def git_state(folder: Path) -> dict[str, Any]:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=folder, capture_output=True, text=True, timeout=10).stdout.strip()

    try:
        commit = git("rev-parse", "HEAD")
        return {"commit": commit or None, "dirty": bool(git("status", "--porcelain")) if commit else None}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}
