"""What hf_tune decides for a run, decided once: one pure value computed from the recipe, its training arguments, the
model's config and this machine, which ``plan``, ``validate`` (``hf-tune validate``'s marked defaults), ``init`` and
``run.json`` read. The build applies the same rules to the loaded model (``build_model`` chooses the attention,
``causal_loss`` proves the chunked loss on the head); what it ran is recorded beside this value in ``run.json``."""

from __future__ import annotations

import dataclasses
from typing import Any

from transformers import TrainingArguments

from hf_tune.errors import RecipeError
from hf_tune.catalog.formats import format_of
from hf_tune.catalog.methods import method_of
from hf_tune.catalog.tasks import task_of
from hf_tune.training_args import computes_in_half_precision
from hf_tune.data import decide_padding_free
from hf_tune.model.attention import NAME as SDPA_VARLEN, default_attn_implementation
from hf_tune.model.attention_choice import flash_candidates
from hf_tune.model.chunked_head import expects_chunked_loss
from hf_tune.model.meta import config_model_class, load_model_config, meta_dtype
from hf_tune.model.moe import is_moe_config
from hf_tune.recipe.schema import Recipe
from hf_tune.trainer.preemption import saves_on_signal


@dataclasses.dataclass(frozen=True)
class RunDecisions:
    """Every choice hf_tune makes for a run where the recipe may be silent."""

    weights_dtype: str  # what the weights load in
    mixed_precision: str | None  # "bf16", "fp16" or None: the matmuls' autocast
    attention: str | None  # None: transformers' own choice (not a causal LM, or the packing probe failed)
    padding_free: bool  # flattened rows of whole examples
    chunked_loss: bool  # no [tokens, vocabulary] logits (hf_tune's chunked loss, or TRL's fused head)
    liger: bool  # Liger's kernels (training.use_liger_kernel)
    checkpointing: bool  # activation checkpointing (training's or FSDP's)
    checkpointing_kwargs: dict | None
    micro_batch_tokens: int  # tokens one rank's micro-batch holds at most
    resume_from_checkpoint: str
    save_on_signal: bool
    router_aux_loss_coef: float | None = None  # a mixture of experts' load-balancing loss in SFT (None: off)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def decide(recipe: Recipe, args: TrainingArguments, config=None, model_class: type | None = None) -> RunDecisions:
    """The run's decisions. ``config``: the model's (read from where ``from_pretrained`` finds it, or the copy
    hf_tune ships, when not given); ``model_class``: the class the run builds (found from the config when not given:
    a built run passes its own, a remote-code model's included); no weight and no tokenizer is read."""
    task, method = task_of(recipe.model.task), method_of(recipe.method)
    config = config if config is not None else load_model_config(recipe)
    mixed = "bf16" if args.bf16 else "fp16" if args.fp16 else None
    attention, padding_free = recipe.model.attn_implementation, False
    if task.causal and not method.uses_trl:
        model_class = model_class or config_model_class(recipe, config)
        if attention is None:
            attention = decide_attention(recipe, model_class, config)
        padding_free = decide_padding_free(recipe, model_class, attention, config)
    fsdp_config = args.fsdp_config if isinstance(getattr(args, "fsdp_config", None), dict) else {}
    checkpointing = bool(recipe.training.get("activation_checkpointing") or recipe.training.get(
        "gradient_checkpointing") or getattr(args, "gradient_checkpointing", False)
        or fsdp_config.get("activation_checkpointing"))
    kwargs = (recipe.training.get("activation_checkpointing_kwargs")
              or recipe.training.get("gradient_checkpointing_kwargs"))
    # no [tokens, vocabulary] logits: TRL's fused LM head (DPO, KTO, GRPO), or hf_tune's chunked loss (SFT; a
    # vision-language run's is decided on the model alone)
    chunked = method.uses_trl or (not task.vision_language and task.causal and expects_chunked_loss(recipe))
    return RunDecisions(
        weights_dtype=str(meta_dtype(recipe, config)).removeprefix("torch."), mixed_precision=mixed,
        attention=attention, padding_free=padding_free, chunked_loss=chunked,
        liger=bool(recipe.training.get("use_liger_kernel")), checkpointing=checkpointing,
        checkpointing_kwargs=kwargs, micro_batch_tokens=micro_batch_tokens(recipe, args),
        resume_from_checkpoint=str(recipe.training.get("resume_from_checkpoint", "auto")),
        save_on_signal=saves_on_signal(recipe), router_aux_loss_coef=router_loss_coefficient(recipe, config))


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


def decide_attention(recipe: Recipe, model_class: type, config) -> str:
    """The attention ``build_model`` chooses where the recipe is silent: sdpa_varlen where the packing probe proved
    it exact (flash attention instead on a GPU where installed, in half precision), else transformers' sdpa."""
    import torch

    if not getattr(model_class, "_supports_sdpa", True):  # gpt-oss (its attention sinks): transformers' eager
        return "eager"
    if default_attn_implementation(True, model_class, config) != SDPA_VARLEN:
        return "sdpa"
    on_gpu = torch.cuda.is_available() and not recipe.training.get("use_cpu")
    if on_gpu and computes_in_half_precision(recipe):
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
    """What a built run (``build_run``) runs, read off its objects: the attention the model loaded with, the
    collator's padding-free rows, the trainer's loss, its checkpointing and precision. ``run.json`` keeps it."""
    from hf_tune.model.loss import is_chunked
    from hf_tune.model.attention import loaded_attn_implementation

    recipe, args, trainer = run.recipe, run.args, run.trainer
    collator = getattr(trainer, "data_collator", None)
    base = run.model.get_base_model() if hasattr(run.model, "get_base_model") else run.model
    decided = decide(recipe, args, base.config, type(base))
    loss = getattr(trainer, "compute_loss_func", None)
    chunked = decided.chunked_loss if method_of(recipe.method).uses_trl else is_chunked(loss)
    return dataclasses.replace(
        decided, attention=loaded_attn_implementation(run.model),
        padding_free=bool(getattr(collator, "padding_free", decided.padding_free)), chunked_loss=chunked,
        router_aux_loss_coef=getattr(loss, "coefficient", None),
        weights_dtype=str(next(run.model.parameters()).dtype).removeprefix("torch."))
