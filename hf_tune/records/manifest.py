"""``run.json``: what a run was (resolved recipe, code, packages, machine, data) and how it ended. Never a secret."""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

from hf_tune import run_folder
from hf_tune.recipe.schema import Recipe
from hf_tune.records.lineage import run_lineage
from hf_tune.redaction import redact_secrets
from hf_tune.runtime.machine import cpu_name


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


# environment variables that change floating-point results or the kernels chosen
NUMERIC_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA",
               "DNNL_MAX_CPU_ISA", "CUBLAS_WORKSPACE_CONFIG", "NVIDIA_TF32_OVERRIDE", "ACCELERATE_MIXED_PRECISION",
               "ACCELERATE_DYNAMO_BACKEND", "TORCHDYNAMO_DISABLE")


def numerics() -> dict:
    """What beside the packages, data, seed, device and threads can change a run's numbers, for ``reproduce`` to
    name: the CPU model (its vector instructions pick the kernels), torch's deterministic-algorithms switch and
    float32 matmul precision, the launcher, and the environment variables that steer the math libraries."""
    import torch

    launcher = ("deepspeed" if "DEEPSPEED_LAUNCHER" in os.environ or "CROSS_RANK" in os.environ else
                "torchrun" if "TORCHELASTIC_RUN_ID" in os.environ and "ACCELERATE_MIXED_PRECISION" not in os.environ
                else "accelerate" if "ACCELERATE_MIXED_PRECISION" in os.environ else "python")
    return {"cpu": cpu_name(), "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
            "float32_matmul_precision": torch.get_float32_matmul_precision(), "launcher": launcher,
            "env": {key: os.environ[key] for key in NUMERIC_ENV if key in os.environ}}


def write_manifest(run_dir: Path, recipe: Recipe, args, datasets: dict[str, Any], start_time: str,
                   end_time: str | None = None, metrics: dict[str, float] | None = None,
                   rollbacks: list[dict] | None = None, decisions: dict[str, Any] | None = None,
                   resumed_from: str | None = None) -> Path:
    """Write (or rewrite) ``run_dir/run.json``; ``end_time`` is set only when the run finished. ``rollbacks``: those
    of ``resilience.rollback_on_nonfinite`` (kept only when there were some); ``decisions``: what hf_tune decided
    for the run and the build ran (``hf_tune.assembly.decisions.ran``); ``resumed_from``: the checkpoint this launch
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
        "numerics": numerics(),
    }
    path = run_dir / run_folder.MANIFEST
    run_dir.mkdir(parents=True, exist_ok=True)
    staging = run_dir / ".run.json.tmp"
    staging.write_text(json.dumps(redact_secrets(manifest), indent=2, default=str))
    os.replace(staging, path)
    return path
