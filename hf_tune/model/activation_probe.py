"""Activation memory measured on the recipe's own architecture, not taken from a formula.

What one micro-batch keeps for backward depends on details no closed formula follows: the dropout copy at each LoRA
input, PEFT's cast of the adapter input, norms computed in float32, q/k norms, the padded gathers of ``sdpa_varlen``,
autocast's weight copies, the chunked loss. The probe runs them: it builds copies of the recipe's model class from its
config, with the recipe's dtype, attention, LoRA (rank, dropout, targets), activation checkpointing and loss, runs one
training forward of a flattened pack the way a training step does, and reads the CPU allocator's own record (torch's
profiler with ``profile_memory``, its raw allocation events) for the bytes still held when the forward returns
(what backward reads) and the most held through forward and backward.

The copies are small, and the figure is scaled back to the recipe's shape:

- **depth**: copies of 1 and 2 decoder layers; every layer keeps the same bytes, so the model's figure is the
  1-layer figure plus ``layers - 1`` times the difference;
- **width**: hidden size, MLP width, vocabulary and head dimension divided by ``k`` (heads, key-value heads and the
  LoRA rank kept); each kept tensor's size is a width times tokens (a term in ``1/k``), a count of heads or ranks
  times tokens (constant), or, where autocast copies float32 weights or LoRA adds its delta to a mixture of experts'
  fused expert tensors, a weight copy (``1/k**2``), so two widths (three with weight copies) fit the terms exactly
  and give ``k = 1``; a mixture of experts' expert width (``moe_intermediate_size``) is divided too;
- **tokens**: kept tensors grow with the tokens of the pack, but for a few of a fixed size, which the narrowest
  copies run at twice the tokens separate; the figure scales linearly from the probe's pack, which keeps the data's
  padding ratio (a pack's examples padded to its longest, over its tokens: ``sdpa_varlen``'s padded gathers);
- **the chunked loss**: a chunk holds a fixed number of logits whatever the width, so the copies run a tiny chunk and
  one real chunk, measured on the narrow head, is added where the forward ends.

``tests/test_activation_probe.py`` checks the scaled figure against the bytes a real training step of the full
shape keeps, counted with autograd's saved-tensor hooks (an instrument the probe does not use), within 10 %.
Where the probe cannot run the architecture (a vision-language model, a config it cannot shrink or build), the
estimate falls back to ``hf_tune.model.memory.activation_memory``'s formula and says so.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import torch

from hf_tune.model.chunked_logprobs import default_chunk_size
from hf_tune.model.head_probe import loss_transient_per_row, trl_head_transient_per_row, trl_token_chunk
from hf_tune.model.moe import is_moe_config
from hf_tune.model.probe_step import ProbeSetup, measure  # ProbeSetup: re-exported, the probe's input

PROBE_TOKENS = 256  # tokens of the probe's pack: small enough to be cheap, long enough to hold the data's padding
WIDTH_KEYS = ("hidden_size", "intermediate_size", "vocab_size")  # divided by k (head_dim too where the config has it)
# widths only some configs have (a mixture of experts' expert and shared-expert MLPs), divided by k where present
OPTIONAL_WIDTH_KEYS = ("moe_intermediate_size", "shared_expert_intermediate_size")
SHRINK_FACTORS = (32, 16, 8, 4)  # the largest k whose k, k/2 and k/4 divide every width is taken
MIN_HEAD_DIM = 4  # rotary embeddings need an even head dimension; a narrower one changes nothing per token


@dataclasses.dataclass(frozen=True)
class ActivationEstimate:
    """Bytes one micro-batch of ``tokens`` keeps for backward (``kept``) and the most held at once through the
    forward and backward beyond the model states (``peak``), with how they were obtained (``source``: ``probe`` or
    ``formula``) and a line that says so."""

    kept: int
    peak: int
    tokens: int
    source: str
    detail: str


_FITS: dict[tuple, tuple] = {}


def estimate_activations(setup: ProbeSetup, tokens: int, padding_ratio: float | None = None) -> ActivationEstimate:
    """The probe's figures for a micro-batch of ``tokens`` tokens. ``padding_ratio``: a flattened pack's examples,
    padded to its longest, over its tokens (``sdpa_varlen`` pads so; 1 when not given: examples of one length). The
    fit is computed once per setup and padding ratio, and scaled to ``tokens``."""
    ratio = max(1.0, padding_ratio or 1.0) if setup.padding_free else 1.0
    key = (*setup.key(), round(ratio, 2))
    if key not in _FITS:
        _FITS[key] = _fit(setup, ratio)
    (kept, forward_peak, peak), loss_per_row, how = _FITS[key]
    # the loss's largest chunk, in positions: TRL's fused head projects up to TOKEN_CHUNK_SIZE positions at a time
    chunk = min(tokens, trl_token_chunk() if setup.trl_fused_head else default_chunk_size(setup.config.vocab_size))
    # the loss runs at the end of the forward: the forward's level (its copies ran a tiny chunk) plus a real chunk
    peak_bytes = max(peak(tokens), forward_peak(tokens) + loss_per_row * chunk)
    return ActivationEstimate(kept=round(kept(tokens)), peak=round(peak_bytes),
                              tokens=tokens, source="probe", detail=how)


@dataclasses.dataclass(frozen=True)
class Linear:
    """bytes = per_token * tokens + fixed, at the full depth and width."""

    per_token: float
    fixed: float

    def __call__(self, tokens: int) -> float:
        return self.per_token * tokens + self.fixed


def _fit(setup: ProbeSetup, ratio: float) -> tuple[tuple[Linear, Linear, Linear], float, str]:
    """((bytes kept, the forward's peak, the peak through backward) as functions of the tokens, the chunked loss's
    transient per position of a chunk, how), at the recipe's full depth and width: each width and depth at
    ``PROBE_TOKENS``, and the narrowest (every width, where weight-sized buffers need three) also at twice the
    tokens, which separates what does not grow with the tokens
    (buffers of a fixed size) from what does."""
    config = setup.config
    layers = config.num_hidden_layers
    factors = shrink_factors(config)
    if not weight_copies(setup):  # no tensor of a weight's size is kept: two widths fit a + b/k exactly
        factors = factors[:2]
    lengths = probe_lengths(PROBE_TOKENS, ratio)
    # weight-sized buffers (three widths) do not grow with the tokens either: then every width runs twice the tokens
    doubled_at = factors if len(factors) == 3 else factors[:1]
    figures, doubled = {}, {}
    for k in factors:
        for depth in (1, 2):  # one copy built per width and depth, stepped at each token count it is measured at
            runs = [lengths, [2 * n for n in lengths]] if k in doubled_at else [lengths]
            measured = measure(setup, probe_config(config, depth, k), *runs)
            figures[k, depth] = measured[0]
            if k in doubled_at:
                doubled[k, depth] = measured[1]
    fits = []
    for i in range(3):  # kept, forward peak, peak
        fixed = {key: 2 * figures[key][i] - value[i] for key, value in doubled.items()}  # 2 m(T) - m(2T)
        fixed_full = _extrapolate(fixed, doubled_at, layers)
        at_full = _extrapolate({key: value[i] for key, value in figures.items()}, factors, layers)
        fits.append(Linear((at_full - fixed_full) / PROBE_TOKENS, fixed_full))
    # the chunked loss's chunk: the copies run a tiny one, this is the real one's, per position (up to a chunk)
    transient = (trl_head_transient_per_row(setup, config) if setup.trl_fused_head else
                 loss_transient_per_row(setup, probe_config(config, 1, factors[0]), factors[0], PROBE_TOKENS)
                 if setup.chunked_loss else 0.0)
    widths = f"1/{', 1/'.join(str(k) for k in factors)} width" if factors != (1,) else "full width"
    how = (f"measured on 1- and 2-layer copies at {widths}, {PROBE_TOKENS} and {2 * PROBE_TOKENS} tokens in "
           f"{len(lengths)} example{'s' if len(lengths) > 1 else ''}, scaled to {layers} layers, full width and the "
           "micro-batch's tokens")
    return tuple(fits), transient, how


def _extrapolate(figures: dict, factors: tuple[int, ...], layers: int) -> float:
    """The full model's figure: per depth, the width fit evaluated at k = 1; then linear in depth."""
    at_full_width = {depth: width_fit([(k, figures[k, depth]) for k in factors]) for depth in (1, 2)}
    return at_full_width[1] + (layers - 1) * (at_full_width[2] - at_full_width[1])


def width_fit(points: list[tuple[int, float]]) -> float:
    """The value at k = 1 of ``a + b / k + c / k**2`` through the given (k, value) points (as many terms as points)."""
    if len(points) == 1:
        return points[0][1]
    terms = len(points)
    matrix = torch.tensor([[1.0 / k ** power for power in range(terms)] for k, _ in points], dtype=torch.float64)
    values = torch.tensor([value for _, value in points], dtype=torch.float64)
    coefficients = torch.linalg.solve(matrix, values)
    return float(coefficients.sum())


def weight_copies(setup: ProbeSetup) -> bool:
    """Whether a training step keeps copies the size of weights (``1/k**2`` under the width divisor k): autocast's
    16-bit copies of float32 weights under mixed precision, or a mixture of experts whose fused expert tensors LoRA
    adapts (PEFT's ParamWrapper adds its delta to the whole tensor, ``W + B @ A``, in each forward)."""
    lora = setup.lora or {}
    experts_adapted = is_moe_config(setup.config) and bool(
        lora.get("target_parameters") or lora.get("target_modules") == "all-linear")
    return (setup.mixed_precision and setup.dtype == torch.float32) or experts_adapted


def shrink_factors(config) -> tuple[int, ...]:
    """Three width divisors ``k, k/2, k/4`` for the largest ``k`` that divides every width of ``config`` (and leaves
    an even head dimension of at least ``MIN_HEAD_DIM``), or ``(1,)``: the probe then runs the full width."""
    if not all(isinstance(getattr(config, key, None), int) for key in WIDTH_KEYS):
        return (1,)
    head_dim = _head_dim(config)
    for k in SHRINK_FACTORS:
        if k < 4:
            break
        dims = [getattr(config, key) for key in WIDTH_KEYS] + [head_dim] + _optional_widths(config)
        # a mixture of experts' grouped matmuls (transformers' experts kernels) need rows of 16 bytes: widths in 8s
        expert_dims = [config.hidden_size, config.intermediate_size, *_optional_widths(config)] if is_moe_config(
            config) else []
        if all(dim % k == 0 for dim in dims) and head_dim // k >= MIN_HEAD_DIM and (head_dim // k) % 2 == 0 and all(
                (dim // k) % 8 == 0 for dim in expert_dims):
            return (k, k // 2, k // 4)
    return (1,)


def _optional_widths(config) -> list[int]:
    return [getattr(config, key) for key in OPTIONAL_WIDTH_KEYS if isinstance(getattr(config, key, None), int)]


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def probe_config(config, layers: int, k: int):
    """``config`` with ``layers`` decoder layers (their layer kinds kept from the front of the list) and every width
    divided by ``k``; token ids the narrower vocabulary lacks are dropped."""
    small = copy.deepcopy(config)
    if k > 1:
        small.head_dim = _head_dim(config) // k  # explicit: the heads keep their number, each narrower
        for key in WIDTH_KEYS + OPTIONAL_WIDTH_KEYS:
            if isinstance(getattr(config, key, None), int):
                setattr(small, key, getattr(config, key) // k)
        for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
            ids = getattr(small, key, None)
            if isinstance(ids, int) and ids >= small.vocab_size or isinstance(ids, list):
                setattr(small, key, None if key == "pad_token_id" else 0)
    small.num_hidden_layers = layers
    if isinstance(getattr(small, "layer_types", None), list):
        small.layer_types = small.layer_types[:layers]
    return small


def probe_lengths(tokens: int, ratio: float) -> list[int]:
    """Example lengths of a ``tokens`` pack whose examples padded to the longest hold ``ratio`` times its tokens
    (the longest is ``ratio`` times the mean): one long example and equal short ones."""
    if ratio <= 1.0:
        return [tokens]
    count = min(max(2, math.ceil(ratio)), tokens // 2)
    longest = min(tokens - (count - 1), round(ratio * tokens / count))
    rest = tokens - longest
    short = [rest // (count - 1) + (1 if i < rest % (count - 1) else 0) for i in range(count - 1)]
    return [longest, *short]
