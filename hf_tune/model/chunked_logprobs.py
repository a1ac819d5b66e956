"""Log-probabilities of target tokens from hidden states and an LM head, computed a chunk of positions at a time and
recomputed in the backward pass, so no ``[positions, vocabulary]`` tensor ever exists whole: peak memory is
O(chunk x V) instead of O(N x V). Plain PyTorch (CPU, CUDA, MPS); the first building block of issue 33.

The head is ``logits = softcap * tanh(logit_scale * (hidden @ weight.T + bias) / softcap)`` (``softcap`` None: no
tanh), which covers Llama, Qwen, Mistral (plain), Gemma 2/3 (``final_logit_softcapping``), Cohere (``logit_scale``)
and Granite (``1 / logits_scaling``). Matrix products run in the inputs' dtype (or autocast's), as the model's own
``lm_head`` does; softmax, the log-probabilities and the head's weight gradient accumulate in float32.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
CHUNK_ELEMENTS = 1 << 25  # chunk x vocabulary logits per chunk by default: 128 MiB in float32


def default_chunk_size(vocab_size: int) -> int:
    """Positions per chunk so that one chunk's float32 logits take about 128 MiB."""
    return max(1, CHUNK_ELEMENTS // max(vocab_size, 1))


def chunked_target_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                            bias: torch.Tensor | None = None, *, chunk_size: int | None = None,
                            logit_scale: float = 1.0, softcap: float | None = None) -> torch.Tensor:
    """``log_softmax(head(hidden))[target]`` per position, float32, shaped like ``targets``; 0 where the target is
    -100. ``hidden``: ``[N, H]`` or ``[B, T, H]``; ``weight``: ``[V, H]``; gradients reach ``hidden``, ``weight``
    and ``bias`` (whichever require them)."""
    return _kept_positions(hidden, weight, targets, bias, chunk_size, logit_scale, softcap, stats=False).logprobs


@dataclass(frozen=True)
class TargetStats:
    """Per position (shaped like the targets, 0 where the target is -100): the target's log-probability (with its
    gradient), and, without one, the distribution's entropy, the mean logit and whether the target is the top
    logit (what TRL's preference trainers log)."""

    logprobs: torch.Tensor
    entropy: torch.Tensor
    mean_logits: torch.Tensor
    is_top1: torch.Tensor


def chunked_target_stats(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         bias: torch.Tensor | None = None, *, chunk_size: int | None = None,
                         logit_scale: float = 1.0, softcap: float | None = None) -> TargetStats:
    """``chunked_target_logprobs`` and the statistics of ``TargetStats``, from the same chunks of logits."""
    return _kept_positions(hidden, weight, targets, bias, chunk_size, logit_scale, softcap, stats=True)


def _kept_positions(hidden, weight, targets, bias, chunk_size, logit_scale, softcap, stats: bool) -> TargetStats:
    """The chunked head over the positions whose target is kept, scattered back to the targets' shape."""
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"hidden states {tuple(hidden.shape)} and targets {tuple(targets.shape)} disagree on the "
                         "positions")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"LM head weight {tuple(weight.shape)} is not [vocabulary, {hidden.shape[-1]}] (a sharded "
                         "or quantized head is not supported)")
    if softcap is not None and softcap <= 0:
        raise ValueError(f"softcap must be positive, got {softcap}")
    chunk_size = chunk_size or default_chunk_size(weight.shape[0])
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be at least 1, got {chunk_size}")
    flat_targets = targets.reshape(-1)
    kept = (flat_targets != IGNORE_INDEX).nonzero().squeeze(1)
    rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, kept)
    compute_dtype = _compute_dtype(hidden)
    # a frozen head (LoRA): the rows' gradient is computed in forward, with no logits recomputed in backward
    rows_only = torch.is_grad_enabled() and rows.requires_grad and not weight.requires_grad and not (
        bias is not None and bias.requires_grad)
    outputs = _ChunkedTargetLogprobs.apply(rows, weight, bias, flat_targets.index_select(0, kept), chunk_size,
                                           float(logit_scale), softcap, compute_dtype, rows_only, stats)

    def scattered(values: torch.Tensor) -> torch.Tensor:
        if values.numel() != kept.numel():  # a statistic not asked for
            return values
        whole = torch.zeros(flat_targets.shape, dtype=values.dtype, device=hidden.device)
        return whole.index_put((kept,), values).reshape(targets.shape)

    return TargetStats(*(scattered(values) for values in outputs))


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                          bias: torch.Tensor | None = None, *, reduction: str = "mean", chunk_size: int | None = None,
                          logit_scale: float = 1.0, softcap: float | None = None) -> torch.Tensor:
    """Cross-entropy of the targets (-100 ignored), float32: ``sum`` over kept positions, or their ``mean`` (0 when
    none is kept, where ``F.cross_entropy`` gives NaN: a batch without trained tokens then adds nothing)."""
    if reduction not in ("sum", "mean"):
        raise ValueError(f"reduction must be 'sum' or 'mean', got {reduction!r}")
    total = -chunked_target_logprobs(hidden, weight, targets, bias, chunk_size=chunk_size, logit_scale=logit_scale,
                                     softcap=softcap).sum()
    if reduction == "sum":
        return total
    return total / max(int((targets != IGNORE_INDEX).sum()), 1)


def _compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    """The dtype the head's matrix product runs in: autocast's where it is on, else the hidden states'."""
    device_type = hidden.device.type
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return hidden.dtype


def _autocast_off(device_type: str):
    """A context where the products run in the dtype chosen by ``_compute_dtype``, not autocast's again."""
    available = torch.amp.is_autocast_available(device_type)
    return torch.autocast(device_type, enabled=False) if available else contextlib.nullcontext()


def _chunk_logits(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, logit_scale: float,
                  softcap: float | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk's float32 logits, and d(logits)/d(raw logits) where the head applies more than the identity."""
    logits = F.linear(rows, weight, bias).float()
    if softcap is not None:
        logits.mul_(logit_scale / softcap).tanh_()
        slope = (1 - logits.square()).mul_(logit_scale)
        return logits.mul_(softcap), slope
    if logit_scale != 1.0:
        return logits.mul_(logit_scale), None
    return logits, None


def _logprob_grad_of_logits(logits: torch.Tensor, logsumexp: torch.Tensor, targets: torch.Tensor,
                            grad_out: torch.Tensor | None, slope: torch.Tensor | None, logit_scale: float
                            ) -> torch.Tensor:
    """``grad_out`` times d logp[target] / d(raw logits) of one chunk (1 where ``grad_out`` is None), in place of
    ``logits``: onehot(target) - softmax, through the scale and softcap."""
    # d logp[t] / d logits = onehot(t) - softmax(logits)
    grad_logits = logits.sub_(logsumexp[:, None]).exp_()
    if grad_out is None:
        grad_logits.neg_().scatter_add_(1, targets[:, None], torch.ones_like(logsumexp)[:, None])
    else:
        grad_logits.mul_(-grad_out).scatter_add_(1, targets[:, None], grad_out)
    if slope is not None:
        return grad_logits.mul_(slope)
    if logit_scale != 1.0:
        return grad_logits.mul_(logit_scale)
    return grad_logits


def _chunk_stats(logits: torch.Tensor, logsumexp: torch.Tensor, targets: torch.Tensor, entropy: torch.Tensor,
                 mean_logits: torch.Tensor, is_top1: torch.Tensor) -> None:
    """One chunk's ``TargetStats`` statistics, written into the given slices (``logits`` left unchanged)."""
    probabilities = (logits - logsumexp[:, None]).exp_()
    entropy.copy_(logsumexp - (probabilities.mul_(logits)).sum(-1))
    mean_logits.copy_(logits.mean(-1))
    is_top1.copy_(logits.argmax(-1) == targets)


class _ChunkedTargetLogprobs(torch.autograd.Function):
    """Target log-probabilities of kept rows. Where only the rows need a gradient (``ahead``: a frozen head, LoRA),
    forward also computes each row's d logp / d row while its chunk's logits exist, and saves that ``[rows, H]`` alone:
    as each log-probability depends on its own row only, backward is a per-row scale, with no logits recomputed. Where
    the head trains, forward saves only the inputs and one log-sum-exp per row, and backward recomputes the logits."""

    @staticmethod
    def forward(ctx, rows, weight, bias, targets, chunk_size, logit_scale, softcap, compute_dtype, ahead, stats):
        with _autocast_off(rows.device.type):
            w, b = weight.to(compute_dtype), None if bias is None else bias.to(compute_dtype)
            logprobs = torch.empty(rows.shape[0], dtype=torch.float32, device=rows.device)
            logsumexp = torch.empty_like(logprobs)
            kept = rows.shape[0] if stats else 0
            entropy, mean_logits = logprobs.new_empty(kept), logprobs.new_empty(kept)
            is_top1 = torch.empty(kept, dtype=torch.bool, device=rows.device)
            grad_rows = torch.empty(rows.shape, dtype=torch.float32, device=rows.device) if ahead else None
            for start in range(0, rows.shape[0], chunk_size):
                end = min(start + chunk_size, rows.shape[0])
                logits, slope = _chunk_logits(rows[start:end].to(compute_dtype), w, b, logit_scale, softcap)
                logsumexp[start:end] = torch.logsumexp(logits, dim=-1)
                logprobs[start:end] = logits.gather(1, targets[start:end, None]).squeeze(1) - logsumexp[start:end]
                if stats:
                    _chunk_stats(logits, logsumexp[start:end], targets[start:end], entropy[start:end],
                                 mean_logits[start:end], is_top1[start:end])
                if ahead:
                    grad_logits = _logprob_grad_of_logits(logits, logsumexp[start:end], targets[start:end], None,
                                                          slope, logit_scale)
                    grad_rows[start:end] = grad_logits.to(compute_dtype) @ w
        if ahead:
            ctx.save_for_backward(grad_rows)
        else:
            ctx.save_for_backward(rows, weight, bias, targets, logsumexp)
        ctx.ahead, ctx.rows_dtype = ahead, rows.dtype
        ctx.chunk_size, ctx.logit_scale, ctx.softcap = chunk_size, logit_scale, softcap
        ctx.compute_dtype = compute_dtype
        ctx.mark_non_differentiable(entropy, mean_logits, is_top1)
        return logprobs, entropy, mean_logits, is_top1

    @staticmethod
    def backward(ctx, grad_logprobs, *_statistics):
        if ctx.ahead:
            (grad_rows,) = ctx.saved_tensors
            return (grad_rows * grad_logprobs.float()[:, None]).to(ctx.rows_dtype), *(None,) * 9
        rows, weight, bias, targets, logsumexp = ctx.saved_tensors
        need_rows, need_weight, need_bias = ctx.needs_input_grad[:3]
        dtype = ctx.compute_dtype
        grad_rows = torch.empty_like(rows) if need_rows else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_bias else None
        with _autocast_off(rows.device.type):
            w, b = weight.to(dtype), None if bias is None else bias.to(dtype)
            for start in range(0, rows.shape[0], ctx.chunk_size):
                end = min(start + ctx.chunk_size, rows.shape[0])
                chunk = rows[start:end].to(dtype)
                logits, slope = _chunk_logits(chunk, w, b, ctx.logit_scale, ctx.softcap)
                grad_logits = _logprob_grad_of_logits(logits, logsumexp[start:end], targets[start:end],
                                                      grad_logprobs[start:end, None].float(), slope, ctx.logit_scale)
                if need_bias:
                    grad_bias += grad_logits.sum(0)
                grad_logits = grad_logits.to(dtype)
                if need_rows:
                    grad_rows[start:end] = (grad_logits @ w).to(rows.dtype)
                if need_weight and dtype == torch.float32:
                    grad_weight.addmm_(grad_logits.T, chunk)  # in place: no [V, H] temporary per chunk
                elif need_weight:
                    grad_weight += (grad_logits.T @ chunk).float()
        grad_weight = None if grad_weight is None else grad_weight.to(weight.dtype)
        grad_bias = None if grad_bias is None else grad_bias.to(bias.dtype)
        return grad_rows, grad_weight, grad_bias, *(None,) * 7


@dataclass(frozen=True)
class LogitHead:
    """A model's LM head as the chunked log-probabilities read it: its Linear (weight read at each call, so moves
    and trained rows are seen) and what the model applies to that Linear's output."""

    linear: torch.nn.Linear
    logit_scale: float = 1.0
    softcap: float | None = None

    def target_logprobs(self, hidden: torch.Tensor, targets: torch.Tensor,
                        chunk_size: int | None = None) -> torch.Tensor:
        """``chunked_target_logprobs`` through this head."""
        return chunked_target_logprobs(hidden, self.linear.weight, targets, self.linear.bias, chunk_size=chunk_size,
                                       logit_scale=self.logit_scale, softcap=self.softcap)
