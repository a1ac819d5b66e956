"""DeepSpeed, in one place: the bundled configs (shipped inside the package), short names, the checks a recipe's
config gets when it loads, and the process group ZeRO-3 needs on CPU.

A recipe names a config by its short name (``zero3``) or by a JSON path. The recipe, ``run.json`` and the model card
keep what the user wrote; only ``TrainingArguments`` gets the loaded JSON, so no absolute path of the training machine
is written anywhere.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from hf_tune.errors import HfTuneError, RecipeError
from hf_tune.runtime.distributed import accelerator_available

BUNDLED_DS_CONFIGS = Path(__file__).resolve().parent.parent / "ds_configs"


def bundled_names() -> list[str]:
    return sorted(p.stem for p in BUNDLED_DS_CONFIGS.glob("*.json"))


def deepspeed_config_path(value: str) -> Path:
    """A bundled config's short name (zero2, zero3_offload, ...) or a path to a JSON file."""
    bundled = BUNDLED_DS_CONFIGS / f"{value.removesuffix('.json')}.json"
    if "/" not in value and bundled.is_file():
        return bundled
    path = Path(value).expanduser()
    if not path.is_file():
        raise RecipeError("training.deepspeed", f"file not found: {value}",
                          fix=f"a JSON path, or one of {bundled_names()}")
    return path


def load_deepspeed_config(value: str | dict[str, Any]) -> dict[str, Any]:
    """The config as a new dict (Trainer fills its "auto" values in place, so every caller gets its own copy)."""
    if isinstance(value, dict):
        return json.loads(json.dumps(value))
    path = deepspeed_config_path(value)
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise RecipeError("training.deepspeed", f"{path.name} is not valid JSON: {err}") from None
    if not isinstance(config, dict):
        raise RecipeError("training.deepspeed", f"{path.name} holds a {type(config).__name__}, not a JSON object")
    return config


# DeepSpeed key -> (TrainingArguments key, its default): a non-"auto" DeepSpeed value must agree with the recipe
_DS_MIRRORS = {
    "train_micro_batch_size_per_gpu": ("per_device_train_batch_size", 8),
    "gradient_accumulation_steps": ("gradient_accumulation_steps", 1),
    "gradient_clipping": ("max_grad_norm", 1.0),
    "bf16.enabled": ("bf16", False),
    "fp16.enabled": ("fp16", False),
}


def check_deepspeed_config(training: dict[str, Any], optim_given: bool) -> None:
    """The config exists and parses, its ZeRO stage is known, its non-"auto" values agree with the recipe, and it
    has no optimizer or scheduler block that would silently replace the optim section."""
    config = training.get("deepspeed")
    if not config:
        return
    name = deepspeed_config_path(config).name if isinstance(config, str) else "the DeepSpeed config"
    config = load_deepspeed_config(config)  # the recipe keeps the short name or path the user wrote
    stage = config.get("zero_optimization", {}).get("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise RecipeError("training.deepspeed", f"{name}: unknown ZeRO stage {stage!r}", fix="use 0, 1, 2 or 3")
    for ds_key, (key, default) in _DS_MIRRORS.items():
        node = config
        for part in ds_key.split("."):
            node = node.get(part, "auto") if isinstance(node, dict) else "auto"
        wanted = training.get(key, default)
        if node != "auto" and node != wanted:
            raise RecipeError("training.deepspeed", f"{name} sets {ds_key}={node!r} but training.{key} is {wanted!r}",
                              fix=f'set {ds_key} to "auto" in the JSON (Trainer fills it from training.{key}), '
                              "or make the two equal")
    if optim_given and "optimizer" in config:
        raise RecipeError("training.deepspeed", "the DeepSpeed config has an 'optimizer' block, which replaces the "
                          "optimizer and so silently drops the optim section (layer-wise LR decay, no-decay groups)",
                          fix="remove the 'optimizer' block from the DeepSpeed JSON: Trainer then builds the "
                          "optimizer from training.optim and hf_tune's groups, and DeepSpeed steps it")
    if optim_given and "scheduler" in config:
        raise RecipeError("training.deepspeed", "the DeepSpeed config has a 'scheduler' block, which replaces the "
                          "warmup-cosine schedule", fix="remove the 'scheduler' block from the DeepSpeed JSON")


STALE_BUILD_S = 30 * 60  # no file of a build folder written for this long: the build that holds its lock is dead


def refuse_stale_extension_locks() -> None:
    """DeepSpeed builds its ops with torch's JIT (``cpp_extension.load``), which waits, silently and for ever, while
    the build folder's ``lock`` file exists. A build killed midway (a preempted job, a timeout) leaves that file
    behind, and every later DeepSpeed run on the machine hangs at start (a CI run waited 48 minutes). A lock whose
    folder nobody has written to for ``STALE_BUILD_S`` is refused with its path, before DeepSpeed starts."""
    import time

    from torch.utils.cpp_extension import get_default_build_root

    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())  # the root torch's JIT uses
    now = time.time()
    for lock in sorted(root.glob("*/*/lock")):  # torch's layout: ROOT/py311_cpu/NAME/lock
        try:
            last_write = max(p.stat().st_mtime for p in lock.parent.iterdir())
        except (FileNotFoundError, ValueError):  # the build ended while we looked
            continue
        if now - last_write > STALE_BUILD_S:
            raise HfTuneError(
                f"DeepSpeed would wait for ever on {lock}: a build of its op '{lock.parent.name}' was interrupted "
                f"{(now - last_write) / 60:.0f} minutes ago and left its lock behind\n"
                f"  fix: delete {lock} (torch rebuilds the op at the next start), then run again")


def init_cpu_deepspeed(kwargs: dict) -> None:
    """ZeRO-3's ``zero.Init`` (used by ``from_pretrained``) fails on CPU unless DeepSpeed's process group is up with
    gloo before ``TrainingArguments`` is built (measured); on an accelerator DeepSpeed picks its own backend."""
    if not kwargs.get("deepspeed") or accelerator_available() or "WORLD_SIZE" not in os.environ:
        return
    import deepspeed
    import torch.distributed as dist

    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo")
    release_shared_allreduce_buffer()


def shared_allreduce_buffer(rank: int) -> Path:
    """The shared-memory segment DeepSpeed's CPU all-reduce maps for ``rank`` when every rank is on this machine
    (its ``shm.cpp``: name from the user id, MASTER_ADDR, MASTER_PORT and the rank)."""
    return Path("/dev/shm") / (f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
                               f"{os.environ.get('MASTER_PORT', '')}_{rank}")


def release_shared_allreduce_buffer() -> None:
    """DeepSpeed never unlinks its CPU all-reduce segments (64 MB per rank in /dev/shm, which is RAM), so every run
    left them behind until a reboot: 14 GB had piled up on the development machine. Once every rank has mapped every
    segment (DeepSpeed's init waits for that, then this barrier), each rank unlinks its own; the mappings stay valid,
    and the memory is freed when the run's processes exit, even killed ones."""
    import torch.distributed as dist

    world = dist.get_world_size()
    if os.environ.get("LOCAL_SIZE") != str(world):  # DeepSpeed's own condition for the segments (all ranks local)
        return
    dist.barrier()
    shared_allreduce_buffer(dist.get_rank()).unlink(missing_ok=True)
