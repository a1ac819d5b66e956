"""``training`` section -> ``transformers.TrainingArguments``, with the defaults a CPU-only machine needs and the
ones a CUDA GPU needs (bf16 where the card has it, no host sync in the hot path)."""

from __future__ import annotations

import dataclasses
import functools
import logging
import os

from transformers import TrainingArguments

from hf_tune.catalog.methods import method_of
from hf_tune.errors import RecipeError
from hf_tune.optim.schedule import resolve_schedule
from hf_tune.recipe.schema import Recipe
from hf_tune.recipe.upstream import blame_key
from hf_tune.runtime.distributed import accelerator_available
from hf_tune.runtime.ds_config import init_cpu_deepspeed, load_deepspeed_config, refuse_stale_extension_locks

logger = logging.getLogger(__name__)


def training_kwargs(recipe: Recipe) -> dict:
    """The recipe's ``training`` keys plus what hf_tune fills in when the recipe is silent."""
    kwargs = resolve_schedule(recipe.training, recipe.optim)  # a no-op for a recipe from load_recipe
    tracking = recipe.tracking  # the run's name and project reach every tracker through Trainer's own arguments
    if tracking.name and "run_name" not in kwargs:
        kwargs["run_name"] = tracking.name
    if tracking.project and "project" not in kwargs:  # Trackio's project
        kwargs["project"] = tracking.project
    if "use_cpu" not in kwargs and not accelerator_available():
        kwargs["use_cpu"] = True  # without it, a CPU run under torchrun trains each rank alone
    if kwargs.get("deepspeed"):  # the JSON itself: the recipe keeps the short name (zero3) or path it was given
        kwargs["deepspeed"] = load_deepspeed_config(kwargs["deepspeed"])
    if not kwargs.get("use_cpu"):
        added = gpu_defaults(kwargs, *_cuda_facts(), launcher_precision=os.environ.get("ACCELERATE_MIXED_PRECISION"))
        kwargs.update(added)
        if added.get("bf16"):
            _log_bf16_default()
    if recipe.data.batch_tokens and "per_device_train_batch_size" not in kwargs:
        kwargs["per_device_train_batch_size"] = 1  # one pack of up to data.batch_tokens tokens per step and device
    if recipe.data.streaming and "accelerator_config" not in kwargs:
        # Each rank reads its share of the stream. accelerate's default for an IterableDataset reads on rank 0 and
        # slices every tensor of a batch along its first dimension, cutting a flattened pack's example boundaries.
        kwargs["accelerator_config"] = {"dispatch_batches": False}
    method = method_of(recipe.method)
    for key, value in (*method.config_fixed, *method.config_defaults):  # what makes the method (simpo: CPO's loss)
        kwargs.setdefault(key, value)
    if method.reference and "precompute_ref_log_probs" in _fields(method.config):
        # computed once and cached across runs (hf_tune.trainer.reference): the steps then run no reference forward
        kwargs.setdefault("precompute_ref_log_probs", True)
    if method.reference and not {"activation_checkpointing", "gradient_checkpointing"} & kwargs.keys():
        kwargs["activation_checkpointing"] = True  # TRL's default, stated so that `hf-tune effective` shows it
        if kwargs.get("precompute_ref_log_probs"):
            _log_reference_checkpointing(recipe.method)
    return kwargs


@functools.cache  # once per process, like the bf16 line
def _log_reference_checkpointing(method: str) -> None:
    logger.info("training.activation_checkpointing: true (TRL's %s default, kept): with the reference "
                "log-probabilities precomputed, a step's recompute costs about the reference forward it no longer "
                "runs, and the step keeps each layer's input instead of every activation (benchmarks/dpo_memory.py)",
                method)


def gpu_defaults(kwargs: dict, cuda: bool, bf16_supported: bool, launcher_precision: str | None = None) -> dict:
    """What a CUDA run adds to the recipe's training keys ``kwargs``: bf16 when the card supports it and nothing set
    the precision (training.bf16 / fp16, a DeepSpeed config's own, ``accelerate launch``'s fp16 or fp8), and no
    ``logging_nan_inf_filter`` (its check syncs the host on every micro-step; hf_tune's NaN guard stops the run
    before a non-finite loss is ever logged)."""
    if not cuda:
        return {}
    added = {}
    if (bf16_supported and not {"bf16", "fp16"} & kwargs.keys() and not _deepspeed_sets_precision(kwargs)
            and launcher_precision not in ("fp16", "fp8")):
        added["bf16"] = True
    if "logging_nan_inf_filter" not in kwargs:
        added["logging_nan_inf_filter"] = False
    return added


def computes_in_half_precision(recipe: Recipe, args: TrainingArguments) -> bool:
    """Whether the run's matmuls run in bf16 or fp16: its arguments' bf16 / fp16 (hf_tune's GPU default included), the
    DeepSpeed config's own, or a half-precision model dtype. Reads the arguments built once for the run."""
    config = args.deepspeed if isinstance(args.deepspeed, dict) else {}
    by_deepspeed = any(isinstance(config.get(kind), dict) and config[kind].get("enabled") is True
                       for kind in ("fp16", "bf16"))
    return bool(args.bf16 or args.fp16 or by_deepspeed) or recipe.model.dtype in ("bfloat16", "float16")


def _deepspeed_sets_precision(kwargs: dict) -> bool:
    """The DeepSpeed config enables or disables fp16 / bf16 itself (anything but "auto")."""
    config = kwargs.get("deepspeed")
    blocks = [config.get(kind) for kind in ("fp16", "bf16")] if isinstance(config, dict) else []
    return any(isinstance(block, dict) and block.get("enabled", "auto") != "auto" for block in blocks)


def _cuda_facts() -> tuple[bool, bool]:
    """(a CUDA device is present, it computes in bf16)."""
    import torch

    cuda = torch.cuda.is_available()
    return cuda, cuda and torch.cuda.is_bf16_supported()


@functools.cache  # once per process: the arguments are built again by preflight, plan and each search trial
def _log_bf16_default() -> None:
    import torch

    logger.info("training.bf16: true (%s supports bf16; neither training.bf16 nor training.fp16 is set)",
                torch.cuda.get_device_name())


def _fields(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def build_training_arguments(recipe: Recipe) -> TrainingArguments:
    """The method's config class (``TrainingArguments``, or TRL's ``DPOConfig`` and the like) from the recipe."""
    kwargs = training_kwargs(recipe)
    if kwargs.get("deepspeed"):
        refuse_stale_extension_locks()
    init_cpu_deepspeed(kwargs)
    # hf_tune saves on SIGTERM / SIGUSR1 itself (trainer/preemption.py, attached by attach_callbacks); upstream's
    # callback would also take SIGTERM, on each rank alone, and without our checkpoint marker
    kwargs["enable_jit_checkpoint"] = False
    try:
        return method_of(recipe.method).config(**kwargs)
    except (ValueError, TypeError, ImportError) as err:
        raise RecipeError(blame_key("training", recipe.training, str(err)),
                          f"TrainingArguments refused it: {err}") from err
