"""``run.json``: what a run was (resolved recipe, code, packages, machine, data) and how it ended. Never a secret."""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

from hf_tune.lifecycle import run_folder
from hf_tune.lifecycle.lineage import run_lineage
from hf_tune.recipe.schema import Recipe
from hf_tune.redaction import redact_secrets


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def write_manifest(run_dir: Path, recipe: Recipe, args, datasets: dict[str, Any], start_time: str,
                   end_time: str | None = None, metrics: dict[str, float] | None = None,
                   rollbacks: list[dict] | None = None, decisions: dict[str, Any] | None = None,
                   resumed_from: str | None = None) -> Path:
    """Write (or rewrite) ``run_dir/run.json``; ``end_time`` is set only when the run finished. ``rollbacks``: those
    of ``resilience.rollback_on_nonfinite`` (kept only when there were some); ``decisions``: what hf_tune decided
    for the run and the build ran (``hf_tune.build.decisions.ran``); ``resumed_from``: the checkpoint this launch
    resumed from (its ``train_loss`` and token counts are Trainer's and hf_tune's for this launch's steps only)."""
    import torch

    device = str(args.device)
    if args.device.type == "cuda":
        device += f" ({torch.cuda.get_device_name(args.device)})"
    lineage = run_lineage(recipe, datasets)  # recipe, base model, data fingerprints, git, packages: one function
    manifest = {
        "recipe": lineage["recipe"],
        "base_model": lineage["base_model"],
        "command": sys.argv,
        "packages": lineage["packages"],
        "git": lineage["git"],
        "host": platform.node(),
        "platform": platform.platform(),
        "world_size": args.world_size,
        "device": device,
        "cpu_threads": torch.get_num_threads(),
        "datasets": lineage["datasets"],
        **({"decisions": decisions} if decisions else {}),
        "resumed_from": resumed_from,
        "start_time": start_time,
        "end_time": end_time,
        "metrics": metrics or {},
        **({"rollbacks": rollbacks} if rollbacks else {}),
        "env": {k: os.environ[k] for k in ("CUDA_VISIBLE_DEVICES", "WORLD_SIZE", "WANDB_MODE") if k in os.environ},
    }
    path = run_dir / run_folder.MANIFEST
    run_dir.mkdir(parents=True, exist_ok=True)
    staging = run_dir / ".run.json.tmp"
    staging.write_text(json.dumps(redact_secrets(manifest), indent=2, default=str))
    os.replace(staging, path)
    return path
