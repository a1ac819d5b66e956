"""One training step of a narrow copy of the recipe's model, measured by the CPU allocator's count: the activation
probe's measurement (``hf_tune.model.activation_probe`` fits its figures over several of them)."""

from __future__ import annotations

import dataclasses
import warnings

import torch

from hf_tune.model.allocations import allocations, quiet_profiler
from hf_tune.model.chunked_head import chunked_loss_head, hidden_state_inputs
from hf_tune.model.dropout import use_fast_lora_dropout
from hf_tune.model.loss import ChunkedCausalLMLoss, causal_lm_loss
from hf_tune.model.moe import moe_lora

PROBE_CHUNK_ROWS = 8  # the chunked loss's chunk in the copies (a real one: head_probe)


@dataclasses.dataclass(frozen=True)
class ProbeSetup:
    """What the probe needs to know of a run, decided by the caller from the recipe: the model class and config,
    the dtype of the weights, mixed precision, the attention, padding-free packs, the recipe's LoRA section, a fast
    LoRA dropout, the chunked loss, activation checkpointing (and its kwargs)."""

    model_class: type
    config: object
    dtype: torch.dtype
    mixed_precision: bool
    attention: str | None
    padding_free: bool
    lora: dict | None
    fast_lora_dropout: bool
    chunked_loss: bool
    checkpointing: bool
    checkpointing_kwargs: dict | None = None
    trl_fused_head: bool = False  # the loss is TRL's fused LM head (its methods), not hf_tune's chunked loss

    def key(self) -> tuple:
        config = self.config.to_json_string(use_diff=False)
        lora = repr(sorted((self.lora or {}).items()))
        return (f"{self.model_class.__module__}.{self.model_class.__qualname__}", config, str(self.dtype),
                self.mixed_precision, self.attention, self.padding_free, lora, self.fast_lora_dropout,
                self.chunked_loss, self.checkpointing, repr(self.checkpointing_kwargs), self.trl_fused_head)


def probe_batch(lengths: list[int], vocab_size: int, padding_free: bool) -> dict[str, torch.Tensor]:
    """A training batch of examples with these lengths, every token trained: one flattened row with the example
    boundaries the collator adds (padding-free), else one padded row per example."""
    generator = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, vocab_size, (n,), generator=generator) for n in lengths]
    if padding_free:
        starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        row = torch.cat(ids).unsqueeze(0)
        return {"input_ids": row, "labels": row.clone(),
                "position_ids": torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0),
                "cu_seq_lens_q": starts, "cu_seq_lens_k": starts,
                "max_length_q": max(lengths), "max_length_k": max(lengths)}
    longest = max(lengths)
    rows = torch.zeros(len(lengths), longest, dtype=torch.long)
    mask = torch.zeros(len(lengths), longest, dtype=torch.long)
    for i, example in enumerate(ids):
        rows[i, :len(example)], mask[i, :len(example)] = example, 1
    return {"input_ids": rows, "attention_mask": mask, "labels": rows.masked_fill(mask == 0, -100)}


def measure(setup: ProbeSetup, config, *runs: list[int], chunk_size: int | None = PROBE_CHUNK_ROWS
            ) -> list[tuple[int, int, int]]:
    """For each of ``runs`` (a micro-batch's example lengths): (bytes held when the training forward returns, highest
    held through the forward, highest held through forward and backward) of one training step on a randomly
    initialised ``config`` model built as the run builds it (once for all the runs: each step leaves nothing behind),
    by the CPU allocator's count. The weights, and the gradients of trained ones (model states, counted apart), are
    not included. A GPU's varlen kernels (flash attention) run as ``sdpa_varlen``, as the packing probe runs them."""
    from hf_tune.model.attention import NAME, probed_attention  # importing it registers sdpa_varlen

    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(setup.dtype)
    try:
        with torch.random.fork_rng(devices=[]), torch.device("cpu"):
            torch.manual_seed(0)
            model = setup.model_class(config)
            attention = probed_attention(setup.attention) if setup.attention else None
            if attention == NAME and not setup.padding_free:
                attention = "sdpa"  # padded rows: sdpa_varlen is transformers' SDPA there
            if attention and model.config._attn_implementation != attention:
                model.set_attn_implementation(attention)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # PEFT asks is_gradient_checkpointing
                model = _as_trained(model, setup)
            _drop_gradients(model)
            return [_allocated_through_step(model, probe_batch(lengths, config.vocab_size, setup.padding_free), setup,
                                            chunk_size) for lengths in runs]
    finally:
        torch.set_default_dtype(default_dtype)


def _as_trained(model, setup: ProbeSetup):
    """The model as training runs it: LoRA as ``wrap_lora`` adds it (its dropout, fast or not), checkpointing as
    ``Trainer`` turns it on, in training mode."""
    from peft import LoraConfig, get_peft_model


    if setup.lora is not None:
        if setup.checkpointing:
            model.enable_input_require_grads()
        model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **moe_lora(model, setup.lora)))
        if setup.fast_lora_dropout:
            use_fast_lora_dropout(model)
    if setup.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=setup.checkpointing_kwargs
                                            or {"use_reentrant": False})
    return model.train()


def training_loss(model, batch: dict, chunked: bool, mixed_precision: bool, chunk_size: int | None = None
                  ) -> torch.Tensor:
    """One training forward and its loss as a training step computes them: with mixed precision accelerate runs the
    forward under autocast and casts its outputs to float32 (``convert_outputs_to_fp32``); ``Trainer.compute_loss``
    hands the labels to hf_tune's loss, and ``HfTuneMixin.compute_loss`` runs the chunked one under autocast too,
    from the hidden states, through the model's head."""

    inputs = dict(batch)
    labels = inputs.pop("labels")
    loss_fn = ChunkedCausalLMLoss(chunked_loss_head(model), chunk_size) if chunked else causal_lm_loss
    if chunked:
        inputs = hidden_state_inputs(inputs)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mixed_precision and chunked):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mixed_precision):
            outputs = model(**inputs)
        if mixed_precision:
            outputs = _to_float32(outputs)
        return loss_fn(outputs, labels)


def _to_float32(value):
    """accelerate's ``convert_outputs_to_fp32``: every 16-bit float tensor of a forward's outputs as float32."""
    if torch.is_tensor(value):
        return value.float() if value.dtype in (torch.float16, torch.bfloat16) else value
    if isinstance(value, (tuple, list)):
        return type(value)(_to_float32(item) for item in value)
    if isinstance(value, dict):
        for key in list(value.keys()):
            value[key] = _to_float32(value[key])
    return value


def _drop_gradients(model) -> None:
    """A trained weight's gradient is a model state: dropped as soon as it is accumulated, so a step leaves none."""
    for param in model.parameters():
        if param.requires_grad:
            param.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))


def _allocated_through_step(model, batch: dict, setup: ProbeSetup, chunk_size: int | None
                            ) -> tuple[int, int, int]:
    from torch.profiler import ProfilerActivity, profile

    with quiet_profiler(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as forward_profile:
        loss = training_loss(model, batch, setup.chunked_loss, setup.mixed_precision, chunk_size)
    kept, peak = allocations(forward_profile, 0)
    with quiet_profiler(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as backward_profile:
        loss.backward()
        del loss
    return kept, peak, max(peak, allocations(backward_profile, kept)[1])
