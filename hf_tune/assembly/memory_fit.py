"""The run's memory, fitted to its machine: the estimated peak per rank of a set of decisions (the figures ``plan``
prints and ``init`` compares), the memory budget of the machine the run is on, and the fit that ``decide`` applies
where the recipe is silent (activation checkpointing first, then a smaller micro-batch with more accumulation, so
the effective batch stays as it was)."""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

import torch

from hf_tune.catalog.methods import method_of
from hf_tune.catalog.tasks import task_of
from hf_tune.errors import RecipeError
from hf_tune.model.activation_probe import ActivationEstimate, ProbeSetup, estimate_activations
from hf_tune.model.memory import (
    RUNTIME_RESERVE_BYTES,
    activation_memory,
    model_state_memory,
    model_state_sizes,
    quantized_model_state_memory,
    quantized_weight_memory,
    recipe_setup,
)
from hf_tune.model.quantization import describe
from hf_tune.recipe.schema import Recipe

logger = logging.getLogger(__name__)

# a plan fits in 90 % of the budget: the activations are measured on CPU copies of the model (the probe), but a GPU's
# kernels (flash attention, cuBLAS workspaces) and the allocator's fragmentation are not
HEADROOM = 0.9
CHECKPOINTING_KWARGS = {"use_reentrant": False}  # what the fit turns on (transformers' recommended form)


@dataclasses.dataclass(frozen=True)
class Budget:
    """The memory one rank may use (``bytes``, before ``HEADROOM``) and where the figure comes from."""

    bytes: int
    source: str
    host: bool  # the budget is the host's memory (a CPU run): model states offloaded to the CPU count in it too

    @property
    def usable(self) -> int:
        return int(HEADROOM * self.bytes)

    def describe(self) -> str:
        return f"{self.usable / 2**30:.2f} GB ({HEADROOM:.0%} of {self.bytes / 2**30:.2f} GB, {self.source})"


def memory_budget(recipe: Recipe, args) -> Budget:
    """The memory a rank may use: the GPU's where the run has one, else the recipe's ``machine.gpu_memory_gb`` (the
    machine it was written for), else this host's memory a process may use (its cgroup's limit, else the physical
    memory), shared by the processes launched on it."""
    if torch.cuda.is_available() and not getattr(args, "use_cpu", False):
        device = torch.cuda.current_device()
        return Budget(torch.cuda.get_device_properties(device).total_memory,
                      f"the memory of {torch.cuda.get_device_name(device)}", host=False)
    if recipe.machine is not None and recipe.machine.gpu_memory_gb:
        return Budget(int(recipe.machine.gpu_memory_gb * 2**30), "machine.gpu_memory_gb", host=False)
    total, where = host_memory()
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or 0) or max(1, getattr(args, "world_size", 1))
    return Budget(total // local, where + (f", shared by {local} processes" if local > 1 else ""), host=True)


def host_memory() -> tuple[int, str]:
    """(bytes this process may use, where the figure comes from): the cgroup's limit (v2, then v1) where one is set
    below the physical memory, else the physical memory."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < physical:
            return int(text), f"this host's memory limit ({path})"
    return physical, "this host's memory"


def pack_padding_ratio(train) -> float | None:
    """The most a row's examples, padded to its longest, hold over its tokens (``sdpa_varlen``'s padded gathers; 1:
    examples of one length), for tokenized data (None otherwise, and for a stream, which is not read ahead)."""
    from datasets import Dataset

    if not isinstance(train, Dataset) or "input_ids" not in train.column_names or not len(train):
        return None  # a stream (not read ahead), or data TRL tokenizes itself
    ids = train["input_ids"]
    packed = isinstance(ids[0], list) and len(ids[0]) and isinstance(ids[0][0], list)
    packs = ids if packed else [[example] for example in ids]
    return max(len(pack) * max(map(len, pack)) / max(sum(map(len, pack)), 1) for pack in packs)


def estimate_peak(recipe: Recipe, args, decisions, model, world: int, longest: int | None = None,
                  padding_ratio: float | None = None) -> dict:
    """Model states per rank by setup (a quantized base's stored weights), activations of one micro-batch under
    ``decisions`` (measured by the probe on the recipe's architecture where it can run it, else a formula, said so),
    a teacher's weights, a generating method's key-value cache, and the estimated peak of the setup the recipe runs.
    ``model``: the recipe's model on the meta device; ``longest``: tokens of a vision-language run's longest example
    (its micro-batches are padded to it); ``padding_ratio``: a pack's examples padded to its longest over its tokens
    (``sdpa_varlen`` pads so)."""
    total, trainable, largest = model_state_sizes(model)
    mixed = decisions.mixed_precision is not None
    param_bytes = next(model.parameters()).element_size()
    result = {"memory_per_rank": model_state_memory(total, trainable, largest, world, mixed, param_bytes)}
    quantization = recipe.model.quantization_config
    if quantization:
        weights = quantized_weight_memory(model, quantization)
        result["quantized_weights"] = {**weights, "quantization": describe(quantization)}
        result["memory_per_rank"] = quantized_model_state_memory(weights["bytes"], trainable, 4 * largest, world, mixed)
    result["memory_precision"] = "mixed 16-bit" if mixed else str(next(model.parameters()).dtype).split(".")[-1]
    task, method = task_of(recipe.model.task), method_of(recipe.method)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    tokens = decisions.micro_batch_tokens if task.reads_text else 0
    if task.vision_language:  # the language model's tokens: text and image tokens, padded to the longest example
        tokens = decisions.per_device_train_batch_size * (longest or recipe.data.max_length)
    # the estimate counts a decoder's tokens: an image model's activations (and a VLM's tower's) are not estimated
    activations = None if not tokens else activation_estimate(recipe, decisions, base, tokens, padding_ratio)
    setup = recipe_setup(recipe.training)
    result["activations"] = {"bytes": activations.kept if activations else 0,
                             "peak_bytes": activations.peak if activations else 0, "tokens": tokens,
                             "checkpointing": decisions.checkpointing,
                             "source": activations.source if activations else None,
                             "detail": activations.detail if activations else None}
    result["setup"] = setup
    result["peak_per_rank"] = (result["memory_per_rank"][setup][0] + (activations.peak if activations else 0)
                               + RUNTIME_RESERVE_BYTES)
    if method.generates:  # the key-value cache of one micro-batch's completions while they are sampled
        result["generation_cache_bytes"] = kv_cache_bytes(base.config, decisions, param_bytes)
        result["peak_per_rank"] += result["generation_cache_bytes"]
    if method.teacher:
        result["teacher"] = teacher_memory(recipe, world, setup)
        result["peak_per_rank"] += result["teacher"]["bytes_per_rank"]
    return result


def kv_cache_bytes(config, decisions, element_bytes: int) -> int:
    """Keys and values of every layer for the tokens of a micro-batch of prompts and completions."""
    text = config.get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    return 2 * text.num_hidden_layers * heads * head_dim * decisions.micro_batch_tokens * element_bytes


def activation_estimate(recipe: Recipe, decisions, base, tokens: int,
                        padding_ratio: float | None = None) -> ActivationEstimate:
    """The probe's figure for a causal language model the probe can build; the formula's, said so, otherwise."""
    lora = None if recipe.lora is None else {k: v for k, v in recipe.lora.items()
                                             if k not in ("trainable_token_indices", "modules_to_save")}
    if task_of(recipe.model.task).causal and not task_of(recipe.model.task).vision_language:
        setup = ProbeSetup(
            model_class=type(base), config=base.config, dtype=getattr(torch, decisions.compute_dtype
                                                                      if recipe.model.quantization_config
                                                                      else decisions.weights_dtype),
            mixed_precision=decisions.mixed_precision is not None, attention=decisions.attention,
            padding_free=decisions.padding_free, lora=lora, fast_lora_dropout=recipe.model.fast_lora_dropout,
            chunked_loss=decisions.chunked_loss, checkpointing=decisions.checkpointing,
            checkpointing_kwargs=decisions.checkpointing_kwargs,
            # TRL's fused head, unless the pairs run flattened through hf_tune's chunked head (DPO's default)
            trl_fused_head=method_of(recipe.method).uses_trl and not decisions.padding_free)
        try:
            return estimate_activations(setup, tokens, padding_ratio=padding_ratio)
        except Exception as error:  # an architecture the probe cannot build or run: the formula, said so
            logger.warning("activation probe: %s: %s; activations estimated by formula", type(error).__name__,
                           str(error)[:200])
    kept = activation_memory(base.config, tokens, decisions.checkpointing,
                             logit_positions=0 if decisions.chunked_loss else None,
                             lora_r=(recipe.lora or {}).get("r", 0))
    return ActivationEstimate(kept=kept, peak=kept, tokens=tokens, source="formula",
                              detail="a formula (not measured): the probe does not run this model")


def teacher_memory(recipe: Recipe, world: int, setup: str) -> dict:
    """A distillation teacher's weights per rank: built on the meta device from its config in the dtype the recipe's
    ``teacher`` section loads it in, partitioned over the ranks under ZeRO-3 (TRL prepares it with the student's
    DeepSpeed config) and whole on each rank otherwise. Frozen: no gradients, no optimizer states."""
    from hf_tune.model.meta import build_meta_model

    teacher = build_meta_model(dataclasses.replace(recipe, model=recipe.teacher, lora=None))
    weights = sum(p.numel() * p.element_size() for p in teacher.parameters())
    partitioned = setup.startswith("ZeRO-3")
    return {"name": recipe.teacher.pretrained_model_name_or_path,
            "params": sum(p.numel() for p in teacher.parameters()),
            "dtype": str(next(teacher.parameters()).dtype).split(".")[-1], "bytes": weights,
            "bytes_per_rank": weights // world if partitioned else weights, "partitioned": partitioned}


def peak_on(estimate: dict, budget: Budget) -> int:
    """The estimated peak as the budget counts it: a host's memory holds what a setup offloads to the CPU too."""
    offloaded = estimate["memory_per_rank"][estimate["setup"]][1] if budget.host else 0
    return int(estimate["peak_per_rank"] + offloaded)


def upper_bound(recipe: Recipe, decisions, model, world: int, budget: Budget) -> int:
    """A cheap figure above the peak, without running the probe: the model states, four times the formula's 16-bit
    activations (float32 doubles them; the formula misses a dropout copy, casts and norms) without checkpointing and
    with full logits, a generating method's cache, a teacher counted at four bytes a
    parameter, and the runtime reserve. Where it fits, the run fits whatever the probe would say."""
    total, trainable, largest = model_state_sizes(model)
    states = model_state_memory(total, trainable, largest, world, decisions.mixed_precision is not None,
                                next(model.parameters()).element_size())[recipe_setup(recipe.training)]
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    text = base.config.get_text_config()
    tokens = decisions.micro_batch_tokens if task_of(recipe.model.task).reads_text else 0
    activations = 0 if not hasattr(text, "num_hidden_layers") else 4 * activation_memory(
        base.config, tokens, False, logit_positions=None, lora_r=(recipe.lora or {}).get("r", 0))
    extra = kv_cache_bytes(base.config, decisions, 4) if method_of(recipe.method).generates else 0
    if method_of(recipe.method).teacher:
        extra += 4 * total
    return int(states[0] + (states[1] if budget.host else 0) + activations + extra + RUNTIME_RESERVE_BYTES)


def fit_memory(recipe: Recipe, args, decisions, model, world: int, budget: Budget, padding_ratio: float | None = None):
    """``decisions`` fitted to ``budget``: where the estimated peak would not fit and the recipe is silent, activation
    checkpointing is turned on first, then the micro-batch halved (and the accumulation doubled, so the effective
    batch is unchanged) until it fits or is one example. Returns the decisions with their ``memory`` record: the
    budget, what was changed and why, whether it fits, and the recipe keys that keep it from fitting."""
    record = {"budget_bytes": budget.usable, "budget": budget.describe(), "changed": [], "fits": True,
              "keys_in_the_way": []}
    if model is None or not task_of(recipe.model.task).reads_text or decisions.micro_batch_tokens == 0:
        record["checked"] = "not estimated: the activations of this task are not estimated"
        return dataclasses.replace(decisions, memory=record)
    if upper_bound(recipe, decisions, model, world, budget) <= budget.usable:
        record["checked"] = "an upper bound (model states + four times the formula's activations) fits"
        return dataclasses.replace(decisions, memory=record)
    record["checked"] = "the estimated peak (plan's)"

    def peak(current) -> int:
        return peak_on(estimate_peak(recipe, args, current, model, world, padding_ratio=padding_ratio), budget)

    before = peak(decisions)
    current, figure = decisions, before
    training = recipe.training
    silent_checkpointing = not ({"activation_checkpointing", "gradient_checkpointing"} & training.keys())
    if figure > budget.usable and not current.checkpointing and silent_checkpointing:
        current = dataclasses.replace(current, checkpointing=True,
                                      checkpointing_kwargs=current.checkpointing_kwargs or dict(CHECKPOINTING_KWARGS))
        after = peak(current)
        record["changed"].append(f"training.activation_checkpointing: true (the planned peak, "
                                 f"{figure / 2**30:.2f} GB, exceeds the budget; {after / 2**30:.2f} GB with it)")
        figure = after
    batch_key = "data.batch_tokens" if recipe.data.batch_tokens else "training.per_device_train_batch_size"
    silent_batch = "per_device_train_batch_size" not in training and not recipe.data.batch_tokens
    while figure > budget.usable and silent_batch and current.per_device_train_batch_size > 1:
        smaller = current.per_device_train_batch_size // 2
        scale = current.per_device_train_batch_size // smaller
        current = dataclasses.replace(
            current, per_device_train_batch_size=smaller,
            gradient_accumulation_steps=current.gradient_accumulation_steps * scale,
            micro_batch_tokens=current.micro_batch_tokens // scale)
        after = peak(current)
        record["changed"].append(f"training.per_device_train_batch_size: {smaller} and "
                                 f"training.gradient_accumulation_steps: {current.gradient_accumulation_steps} (the "
                                 f"same effective batch; {figure / 2**30:.2f} GB -> {after / 2**30:.2f} GB)")
        figure = after
    record["fits"] = figure <= budget.usable
    record["peak_bytes"] = figure
    if not record["fits"]:
        if not silent_checkpointing and not current.checkpointing:
            record["keys_in_the_way"].append("training.activation_checkpointing")
        if not silent_batch and current.per_device_train_batch_size * max(1, recipe.data.batch_tokens or 1) > 1:
            record["keys_in_the_way"].append(batch_key)
    return dataclasses.replace(current, memory=record)


def refuse_unfit(decisions) -> None:
    """``RecipeError`` where the fitted decisions still exceed the budget, naming the recipe key that keeps them
    from fitting (or the model, where no silent key is left) and the figures."""
    memory = decisions.memory or {}
    if memory.get("fits", True):
        return
    figures = (f"the planned peak per rank is {memory['peak_bytes'] / 2**30:.2f} GB, over the budget of "
               f"{memory['budget']}")
    keys = memory["keys_in_the_way"]
    if keys:
        raise RecipeError(keys[0], f"{figures} with it as the recipe sets it", fix=f"remove {' and '.join(keys)} "
                          "so that hf_tune fits the run (activation checkpointing first, then a smaller micro-batch "
                          "with more accumulation), or lower it yourself")
    raise RecipeError("model.pretrained_model_name_or_path", f"{figures}, even with activation checkpointing and a "
                      "micro-batch of one example", fix="`hf-tune init MODEL --gpus N --gpu-memory GB` writes a recipe "
                      "that fits (ZeRO, QLoRA, shorter packs), or set machine.gpu_memory_gb to the GPU it runs on")
