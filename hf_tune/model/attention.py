"""Padding-free attention on plain SDPA: every example of a flattened row attends to itself only, at its own cost.

A flattened row (``DataCollatorWithFlattening``) saves the compute of pad tokens in every linear layer, norm and MLP.
Flash attention then runs each example on its own (varlen kernels), but it needs a GPU and the flash-attn package;
transformers' SDPA path instead turns the restarting ``position_ids`` into a block-diagonal mask over the whole row
and computes ``(sum of lengths)**2`` scores instead of ``sum(length**2)``: on a CPU that costs more than the padding
it saves (measured: docs/speed.md), so packs would stay padded there.

``sdpa_varlen`` does what the varlen kernels do with the SDPA that every torch has: it gathers the row's examples
into a right-padded ``[examples, heads, longest, head_dim]`` batch, runs one causal SDPA call (with right padding the
causal mask already hides the pad keys from every real query, so no mask is needed) and gathers the real positions
back. Only attention sees padding, and only up to the longest example of the step. Register it with
``attn_implementation: sdpa_varlen`` (the default for causal LMs where the packing probe proved it exact); whenever a
forward carries no flattened-row boundaries (padded batches, evaluation, generation), or has a sliding window shorter
than its longest example, or a softcap, it is transformers' own SDPA attention with transformers' own SDPA masks.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface, AttentionMaskInterface

from hf_tune.model.packing_probe import probe_padding_free

NAME = "sdpa_varlen"
# Upstream's SDPA attention and mask functions, from transformers' registries (not from their module paths).
sdpa_attention_forward = AttentionInterface()["sdpa"]
sdpa_mask = AttentionMaskInterface()["sdpa"]
# The keyword arguments whose meaning sdpa_varlen knows: the flattened row's boundaries, the sliding window it checks,
# and what models pass down to every layer without bearing on attention (Trainer adds num_items_in_batch to each
# training forward). Any other one that carries a value (a softcap, a position bias, attention sinks, a kwarg a
# future model adds) sends the call to upstream SDPA, which handles it or refuses.
UNDERSTOOD_KWARGS = frozenset({"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "position_ids",
                               "sliding_window", "is_causal", "output_attentions", "use_cache", "num_items_in_batch",
                               "output_hidden_states", "output_router_logits", "seq_idx", "return_dict"})


def sdpa_varlen_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                                  value: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float = 0.0,
                                  scaling: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention-function signature: ``query`` ``[1, heads, tokens, dim]``, ``key``/``value`` with the
    key-value heads; returns ``([1, tokens, heads, dim], None)``."""
    starts, longest = kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q")
    if not _is_flattened_self_attention(module, query, key, starts, longest, kwargs):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    gather, scatter, examples, longest = _layout(starts, longest, query.shape[2])

    def regroup(states: torch.Tensor) -> torch.Tensor:  # [1, heads, tokens, dim] -> [examples, heads, longest, dim]
        tokens_first = states[0].transpose(0, 1)
        padded = tokens_first.index_select(0, gather)
        return padded.view(examples, longest, *tokens_first.shape[1:]).transpose(1, 2)

    gqa = query.shape[1] != key.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(
        regroup(query), regroup(key), regroup(value), dropout_p=dropout, is_causal=True, scale=scaling,
        enable_gqa=gqa)
    out = out.transpose(1, 2).reshape(examples * longest, out.shape[1], out.shape[3])  # back to token rows
    return out.index_select(0, scatter).unsqueeze(0), None


def _is_flattened_self_attention(module, query, key, starts, longest, kwargs) -> bool:
    """A flattened training row: one row, example boundaries given, causal self-attention, only keyword arguments
    it understands, and no sliding window shorter than the longest example (a window at least that long masks
    nothing more than causal)."""
    if any(value is not None and name not in UNDERSTOOD_KWARGS for name, value in kwargs.items()):
        return False
    if kwargs.get("output_attentions") or kwargs.get("is_causal") is False:
        return False
    window = kwargs.get("sliding_window") or getattr(module, "sliding_window", None)  # Mistral passes it as kwarg
    return (starts is not None and query.shape[0] == 1 and query.shape[2] == key.shape[2]
            and getattr(module, "is_causal", True)
            and (window is None or (longest is not None and int(longest) <= window)))


def _layout(starts: torch.Tensor, longest: int | None, tokens: int) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """Index maps between the flattened row and the right-padded example batch: ``gather`` (one source token per
    padded slot; pad slots read token 0, whose output is dropped) and ``scatter`` (the padded slot of each token).
    No host-device synchronisation when the collator gives ``max_length_q``."""
    starts = starts.to(torch.long)
    lengths = starts[1:] - starts[:-1]
    examples = lengths.shape[0]
    longest = int(longest) if longest is not None else int(lengths.max())
    offsets = torch.arange(longest, device=starts.device)
    gather = torch.where(offsets < lengths[:, None], starts[:-1, None] + offsets, 0).flatten()
    example = torch.repeat_interleave(torch.arange(examples, device=starts.device), lengths, output_size=tokens)
    scatter = example * longest + torch.arange(tokens, device=starts.device) - starts[example]
    return gather, scatter, examples, longest


def supports_padding_free(model_class: type, attn_implementation: str | None = NAME, config=None) -> bool:
    """Whether flattened examples give each example its own logits on ``model_class`` under
    ``attn_implementation``: proved once per process by a tiny random model of the architecture (``config``'s layer
    kinds, else its config class's defaults) run packed and alone (``hf_tune.model.packing_probe``). Hybrid models
    whose convolution or state-space layers mix the examples fail it; a model off transformers' attention
    interface (no masks from restarting ``position_ids``) is not tried."""
    if not getattr(model_class, "_supports_attention_backend", False):
        return False
    probed = probed_attention(attn_implementation)
    return probe_padding_free(model_class, probed, runs_examples_apart(probed), config).packs


def probed_attention(attn_implementation: str | None) -> str:
    """The attention the CPU probe runs for the run's: varlen kernels that need a GPU (flash attention, Hub kernels)
    run each example from ``cu_seq_lens_*`` as ``sdpa_varlen`` does; any other one masks as transformers' SDPA."""
    if attn_implementation in (NAME, "sdpa", "eager"):
        return attn_implementation
    return NAME if runs_examples_apart(attn_implementation) else "sdpa"


def default_attn_implementation(causal: bool, model_class: type | None, config=None) -> str | None:
    """``sdpa_varlen`` for causal LMs where the probe proved flattened examples exact under it (``config``: the
    model's, whose layer kinds the probe keeps), else None (transformers chooses)."""
    return NAME if causal and model_class is not None and supports_padding_free(model_class, NAME, config) else None


def loaded_attn_implementation(model) -> str | None:
    """The attention implementation a built model actually runs (PEFT-wrapped or not)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return getattr(base.config, "_attn_implementation", None)


def runs_examples_apart(attn_implementation: str | None) -> bool:
    """Whether the attention runs each example of a flattened row on its own from ``cu_seq_lens_*`` (varlen)."""
    return attn_implementation is not None and (attn_implementation == NAME or "flash" in attn_implementation)


AttentionInterface.register(NAME, sdpa_varlen_attention_forward)
AttentionMaskInterface.register(NAME, sdpa_mask)
