"""What hf_tune decides for a run, decided once: one value computed from the recipe, its training arguments, the
model's config and this machine, before any weight loads. ``build_run`` passes its fields into the builders (the
model's attention and checkpointing, the collator's padding-free rows, the loss's chunking, the micro-batch), and
``plan``, ``validate`` (``hf-tune validate``'s marked defaults), ``init`` and ``run.json`` read the same value. A check
on the real model (flash attention fails to load, the head fails the chunked proof) may only fall back: the fallback
and its reason are recorded (``Run.fall_back``: one log line, and ``fallbacks`` in ``run.json``'s decisions), and
``ran(run)`` asserts that the built run runs its decisions."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from transformers import TrainingArguments

from hf_tune.assembly.memory_fit import Budget, fit_memory, memory_budget
from hf_tune.catalog.formats import format_of
from hf_tune.catalog.methods import method_of
from hf_tune.catalog.tasks import task_of
from hf_tune.data import decide_padding_free
from hf_tune.errors import HfTuneError, RecipeError
from hf_tune.model.attention import NAME as SDPA_VARLEN
from hf_tune.model.attention import (
    default_attn_implementation,
    loaded_attn_implementation,
    runs_examples_apart,
    supports_padding_free,
)
from hf_tune.model.attention_choice import flash_candidates
from hf_tune.model.chunked_head import expects_chunked_loss
from hf_tune.model.loss import is_chunked
from hf_tune.model.meta import build_meta_model, config_model_class, load_model_config, meta_dtype
from hf_tune.model.moe import is_moe_config
from hf_tune.recipe.quantization import weight_sharding
from hf_tune.recipe.schema import Recipe
from hf_tune.trainer.preemption import saves_on_signal
from hf_tune.training_args import computes_in_half_precision

logger = logging.getLogger("hf_tune")


@dataclasses.dataclass(frozen=True)
class RunDecisions:
    """Every choice hf_tune makes for a run where the recipe may be silent."""

    weights_dtype: str  # what the weights load in
    compute_dtype: str  # what the matmuls compute in: autocast's dtype, a quantized base's compute dtype, the weights'
    mixed_precision: str | None  # "bf16", "fp16" or None: the matmuls' autocast
    attention: str | None  # None: transformers' own choice (not a causal LM, or the packing probe failed)
    padding_free: bool  # flattened rows of whole examples
    chunked_loss: bool  # no [tokens, vocabulary] logits (hf_tune's chunked loss, or TRL's fused head)
    liger: bool  # Liger's kernels (training.use_liger_kernel)
    checkpointing: bool  # activation checkpointing (training's or FSDP's)
    checkpointing_kwargs: dict | None
    micro_batch_tokens: int  # tokens one rank's micro-batch holds at most
    per_device_train_batch_size: int  # examples (or packs) of one rank's micro-batch
    gradient_accumulation_steps: int
    resume_from_checkpoint: str
    save_on_signal: bool
    router_aux_loss_coef: float | None = None  # a mixture of experts' load-balancing loss in SFT (None: off)
    memory: dict | None = None  # the fit to the machine's memory (assembly/memory_fit.py): budget, changes, fits
    fallbacks: tuple = ()  # (decision, decided, ran, why) of each check on the real model that fell back

    def to_dict(self) -> dict[str, Any]:
        """As ``run.json`` keeps it (JSON's types: the fallbacks a list)."""
        return {**dataclasses.asdict(self), "fallbacks": [dict(record) for record in self.fallbacks]}


def decide(recipe: Recipe, args: TrainingArguments, config=None, model_class: type | None = None, model=None,
           world: int | None = None, padding_ratio: float | None = None, budget: Budget | None = None,
           fit: bool = True) -> RunDecisions:
    """The run's decisions. ``config``: the model's (read from where ``from_pretrained`` finds it, or the copy
    hf_tune ships, when not given); ``model_class``: the class the run builds (found from the config when not given);
    no weight and no tokenizer is read. With ``fit``, the decisions are fitted to ``budget`` (the machine's memory,
    ``memory_budget``, when not given; ``assembly/memory_fit.py``): ``model`` is the recipe's model on the meta device
    (built from the config when not given), ``world`` the ranks to plan for (when not given: the launch's where it
    is distributed, else ``machine.world_size``),
    ``padding_ratio`` the packs' padding (``pack_padding_ratio``)."""
    task, method = task_of(recipe.model.task), method_of(recipe.method)
    config = config if config is not None else load_model_config(recipe)
    mixed = "bf16" if args.bf16 else "fp16" if args.fp16 else None
    attention, padding_free = recipe.model.attn_implementation, False
    if task.causal and (not method.uses_trl or method.flat_pairs):
        model_class = model_class or config_model_class(recipe, config)
        if attention is None:
            attention = decide_attention(recipe, args, model_class, config)
        padding_free = (decide_flat_pairs(recipe, model_class, attention, config) if method.uses_trl
                        else decide_padding_free(recipe, model_class, attention, config))
    fsdp_config = args.fsdp_config if isinstance(getattr(args, "fsdp_config", None), dict) else {}
    checkpointing = bool(recipe.training.get("activation_checkpointing") or recipe.training.get(
        "gradient_checkpointing") or getattr(args, "gradient_checkpointing", False)
        or fsdp_config.get("activation_checkpointing"))
    kwargs = (recipe.training.get("activation_checkpointing_kwargs")
              or recipe.training.get("gradient_checkpointing_kwargs"))
    # no [tokens, vocabulary] logits: TRL's fused LM head (DPO, KTO, GRPO), or hf_tune's chunked loss (SFT, proven on
    # the model's head when it loads)
    chunked = method.uses_trl or (not task.vision_language and task.causal and expects_chunked_loss(recipe))
    weights = str(meta_dtype(recipe, config)).removeprefix("torch.")
    decided = RunDecisions(
        weights_dtype=weights, compute_dtype=compute_dtype(recipe, mixed, weights), mixed_precision=mixed,
        attention=attention, padding_free=padding_free, chunked_loss=chunked,
        liger=bool(recipe.training.get("use_liger_kernel")), checkpointing=checkpointing,
        checkpointing_kwargs=kwargs, micro_batch_tokens=micro_batch_tokens(recipe, args),
        per_device_train_batch_size=args.per_device_train_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        resume_from_checkpoint=str(recipe.training.get("resume_from_checkpoint", "auto")),
        save_on_signal=saves_on_signal(recipe), router_aux_loss_coef=router_loss_coefficient(recipe, config))
    if not fit:
        return decided
    budget = budget or memory_budget(recipe, args)
    if model is None and task.reads_text:

        try:
            model = build_meta_model(recipe)
        except Exception as error:  # the real build names it (a LoRA target the model lacks: wrap_lora's message)
            memory = {"budget_bytes": budget.usable, "budget": budget.describe(), "changed": [], "fits": True,
                      "keys_in_the_way": [], "checked": f"not estimated: the model did not build on the meta device "
                      f"({type(error).__name__})"}
            return dataclasses.replace(decided, memory=memory)
    if world is None:  # the launch, where it is distributed; else the machine the recipe was written for (validate)
        world = args.world_size if args.world_size > 1 else recipe.machine.world_size if recipe.machine else 1
    return fit_memory(recipe, args, decided, model, world, budget, padding_ratio)


def decide_flat_pairs(recipe: Recipe, model_class: type, attention: str | None, config) -> bool:
    """Whether a DPO run's pairs run as one flattened row (``hf_tune.model.flat_pairs``): ``training.padding_free``
    (TRL's key, which TRL 1.16 turns off), else where the attention runs each sequence on its own (flash,
    sdpa_varlen), the packing probe proved flattened rows exact on the architecture, and no rank holds a shard of the
    weights (the proof runs a forward on the model before training). The run proves it on the model too."""
    asked = recipe.training.get("padding_free")
    if asked is not None:
        return bool(asked)
    return bool(runs_examples_apart(attention) and weight_sharding(recipe) is None
                and supports_padding_free(model_class, attention, config))


def compute_dtype(recipe: Recipe, mixed: str | None, weights: str) -> str:
    """The dtype the matmuls compute in: a quantized base's ``bnb_4bit_compute_dtype`` (float32 when unset, as
    ``BitsAndBytesConfig`` defaults), else autocast's, else the weights'."""
    quantization = recipe.model.quantization_config
    if quantization:
        return str(quantization.get("bnb_4bit_compute_dtype") or "float32").removeprefix("torch.")
    return {"bf16": "bfloat16", "fp16": "float16"}.get(mixed, weights)


def fitted_recipe(decisions: RunDecisions, recipe: Recipe) -> Recipe:
    """The recipe with the memory fit's changes written into its ``training`` section (what ``recipe.yaml`` keeps and
    the run's arguments are built from); the recipe itself where the fit changed nothing."""
    if not (decisions.memory or {}).get("changed"):
        return recipe
    training = dict(recipe.training)
    if decisions.checkpointing and not training.get("activation_checkpointing"):
        training.update(activation_checkpointing=True, activation_checkpointing_kwargs=decisions.checkpointing_kwargs)
    if decisions.per_device_train_batch_size != training.get("per_device_train_batch_size"):
        training.update(per_device_train_batch_size=decisions.per_device_train_batch_size,
                        gradient_accumulation_steps=decisions.gradient_accumulation_steps)
    return dataclasses.replace(recipe, training=training)


def router_loss_coefficient(recipe: Recipe, config) -> float | None:
    """The load-balancing loss's coefficient of an SFT run of a mixture of experts: ``model.router_aux_loss_coef``,
    else the config's own (transformers' MoE models add it only under ``output_router_logits``, off in their
    configs); None where there is no router loss (a dense model, a TRL method, a coefficient of 0 or none)."""
    task, method = task_of(recipe.model.task), method_of(recipe.method)
    applies = task.causal and not method.uses_trl and is_moe_config(config)
    if recipe.model.router_aux_loss_coef and not applies:
        raise RecipeError("model.router_aux_loss_coef", "is the load-balancing loss of a mixture of experts' router in "
                          f"SFT; this run is method {recipe.method} of a model that "
                          f"{'routes' if is_moe_config(config) else 'does not route'} tokens among experts",
                          fix="remove model.router_aux_loss_coef")
    if not applies:
        return None
    text = getattr(config, "text_config", None) or config
    value = recipe.model.router_aux_loss_coef
    value = getattr(text, "router_aux_loss_coef", None) if value is None else value
    return float(value) if value else None


def decide_attention(recipe: Recipe, args: TrainingArguments, model_class: type, config) -> str:
    """The attention a causal LM runs where the recipe is silent: sdpa_varlen where the packing probe proved it exact
    (flash attention instead on a GPU, in half precision, where the model supports it and one is installed), else
    transformers' sdpa. The build applies it; flash failing to load falls back to sdpa_varlen, recorded."""
    import torch

    if not getattr(model_class, "_supports_sdpa", True):  # gpt-oss (its attention sinks): transformers' eager
        return "eager"
    if default_attn_implementation(True, model_class, config) != SDPA_VARLEN:
        return "sdpa"
    on_gpu = torch.cuda.is_available() and not getattr(args, "use_cpu", False)
    if on_gpu and getattr(model_class, "_supports_flash_attn", False) and computes_in_half_precision(recipe, args):
        return next(iter(flash_candidates(torch.cuda.get_device_capability())), SDPA_VARLEN)
    return SDPA_VARLEN


def micro_batch_tokens(recipe: Recipe, args: TrainingArguments) -> int:
    """Tokens one rank's micro-batch holds at most, in the method's own length keys."""
    method, per_device = method_of(recipe.method), args.per_device_train_batch_size
    if method.generates:
        return per_device * ((getattr(args, "max_prompt_length", None) or 512)
                             + (getattr(args, "max_completion_length", None) or 256))
    if method.uses_trl:
        sequences = format_of(recipe.data.format).sequences  # preference pairs: chosen and rejected
        return per_device * sequences * (getattr(args, "max_length", None) or 1024)
    return per_device * (recipe.data.batch_tokens or recipe.data.max_length)


def ran(run) -> RunDecisions:
    """The decisions the built run (``build_run``) runs, checked against what its objects run: the attention the
    model loaded with, the collator's padding-free rows, the trainer's loss, the arguments' checkpointing and batch.
    Each may differ from the decision only where the build recorded a fallback; anything else is an ``HfTuneError``
    (a builder that decided again). ``run.json`` keeps the result."""

    decided, args, trainer = run.decisions, run.args, run.trainer
    sft = not method_of(run.recipe.method).uses_trl
    loss = getattr(trainer, "compute_loss_func", None)
    fsdp_config = args.fsdp_config if isinstance(getattr(args, "fsdp_config", None), dict) else {}
    observed = {"checkpointing": bool(args.activation_checkpointing or fsdp_config.get("activation_checkpointing")),
                "per_device_train_batch_size": args.per_device_train_batch_size,
                "gradient_accumulation_steps": args.gradient_accumulation_steps}
    if decided.attention is not None:
        observed["attention"] = loaded_attn_implementation(run.model)
    if method_of(run.recipe.method).flat_pairs and task_of(run.recipe.model.task).causal:
        observed["padding_free"] = bool(getattr(trainer, "flat_pairs", False))
    if sft and task_of(run.recipe.model.task).causal:
        observed["padding_free"] = bool(getattr(trainer.data_collator, "padding_free", False))
        observed["chunked_loss"] = is_chunked(loss)
        observed["router_aux_loss_coef"] = getattr(loss, "coefficient", None)
    wrong = [f"{name}: decided {getattr(decided, name)!r}, the run has {value!r}" for name, value in observed.items()
             if value != getattr(decided, name)]
    if wrong:
        raise HfTuneError("the built run does not run its decisions (a bug in hf_tune: please report it): "
                          + "; ".join(wrong))
    return decided


def fall_back(decisions: RunDecisions, name: str, value, why: str) -> RunDecisions:
    """``decisions`` with ``name`` set to what the run falls back to, the fallback recorded, and one log line."""
    logger.info("%s: %s decided, %s runs instead (%s)", name, getattr(decisions, name), value, why)
    record = {"decision": name, "decided": getattr(decisions, name), "ran": value, "why": why}
    return dataclasses.replace(decisions, **{name: value}, fallbacks=(*decisions.fallbacks, record))
