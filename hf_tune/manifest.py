"""``run.json``: what a run was (resolved recipe, code, packages, machine, data) and how it ended. Never a secret."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from hf_tune import run_folder
from hf_tune.optim.schedule import resolved_recipe_dict
from hf_tune.recipe.schema import Recipe
from hf_tune.redaction import redact_secrets

PACKAGES = ("hf_tune", "torch", "transformers", "datasets", "accelerate", "peft", "deepspeed", "optuna", "evaluate",
            "wandb")


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def package_versions() -> dict[str, str]:
    versions = {"python": sys.version.split()[0]}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def git_state(folder: Path) -> dict[str, Any]:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=folder, capture_output=True, text=True, timeout=10).stdout.strip()

    try:
        commit = git("rev-parse", "HEAD")
        return {"commit": commit or None, "dirty": bool(git("status", "--porcelain")) if commit else None}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


def write_manifest(run_dir: Path, recipe: Recipe, args, datasets: dict[str, Any], start_time: str,
                   end_time: str | None = None, metrics: dict[str, float] | None = None) -> Path:
    """Write (or rewrite) ``run_dir/run.json``; ``end_time`` is set only when the run finished."""
    import torch

    device = str(args.device)
    if args.device.type == "cuda":
        device += f" ({torch.cuda.get_device_name(args.device)})"
    manifest = {
        "recipe": resolved_recipe_dict(recipe),
        "command": sys.argv,
        "packages": package_versions(),
        "git": git_state(Path.cwd()),
        "host": platform.node(),
        "platform": platform.platform(),
        "world_size": args.world_size,
        "device": device,
        "cpu_threads": torch.get_num_threads(),
        "datasets": {name: {"fingerprint": ds._fingerprint, "examples": len(ds)} for name, ds in datasets.items()
                     if ds is not None},
        "start_time": start_time,
        "end_time": end_time,
        "metrics": metrics or {},
        "env": {k: os.environ[k] for k in ("CUDA_VISIBLE_DEVICES", "WORLD_SIZE", "WANDB_MODE") if k in os.environ},
    }
    path = run_dir / run_folder.MANIFEST
    run_dir.mkdir(parents=True, exist_ok=True)
    staging = run_dir / ".run.json.tmp"
    staging.write_text(json.dumps(redact_secrets(manifest), indent=2, default=str))
    os.replace(staging, path)
    return path
