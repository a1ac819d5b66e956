"""What an LM head's loss holds at its peak, per position of one chunk, for the activation probe
(``hf_tune.model.activation_probe``): hf_tune's chunked loss (``loss_transient_per_row``) and TRL's fused head
(``trl_head_transient_per_row``), each measured on one chunk of a narrow stand-in."""

from __future__ import annotations

import torch

from hf_tune.model.allocations import allocations, quiet_profiler
from hf_tune.model.chunked_logprobs import LogitHead, default_chunk_size
from hf_tune.model.probe_step import ProbeSetup


def loss_transient_per_row(setup: ProbeSetup, config, k: int, most_rows: int) -> float:
    """Bytes the chunked loss holds beyond what it keeps, at its peak, per position of a chunk, for the full-size
    model: measured on one chunk of ``config``'s narrow head (``k`` times narrower, vocabulary included), whose every
    tensor is a chunk's positions times a width, so the full-size figure is ``k`` times it (``most_rows``: the
    positions measured at most)."""
    from torch.profiler import ProfilerActivity, profile


    rows = min(most_rows, default_chunk_size(config.vocab_size))  # one chunk, of at most most_rows positions
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        head = LogitHead(torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=setup.dtype))
        head.linear.weight.requires_grad_(setup.lora is None)  # LoRA leaves the head frozen
        hidden = torch.randn(rows, config.hidden_size, dtype=setup.dtype, requires_grad=True)
        targets = torch.randint(0, config.vocab_size, (rows,))
    with quiet_profiler(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as forward_profile:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=setup.mixed_precision):
            loss = -head.target_logprobs(hidden, targets).sum()
    kept, peak = allocations(forward_profile, 0)
    with quiet_profiler(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as backward_profile:
        loss.backward()
        del loss
    return (max(peak, allocations(backward_profile, kept)[1]) - kept) * k / rows


def trl_token_chunk() -> int:
    """Positions TRL's fused LM head (``trl.kernels.ChunkedLogProbFunction``) projects at once: its module's
    ``TOKEN_CHUNK_SIZE`` (4,096 in TRL 1.16), each against tiles of up to ``chunk_size`` (32,768) vocabulary columns."""
    from trl.kernels import chunked_logprob

    return int(getattr(chunked_logprob, "TOKEN_CHUNK_SIZE", 4096))


# the rows TRL's head is measured on; its tiles are rows x vocabulary columns, so it scales by rows
TRL_PROBE_ROWS = 256


def trl_head_transient_per_row(setup: ProbeSetup, config) -> float:
    """Bytes TRL's fused LM head holds at its peak through forward and backward, per position of one token chunk:
    measured on ``TRL_PROBE_ROWS`` positions of the model's whole vocabulary (its tiles, ``[rows, vocabulary
    columns]``, do not depend on the width, so a narrow hidden size stands in), in the run's dtype and autocast, with
    every per-token output TRL's trainers may ask for. On a CPU its torch path holds several float32 copies of a tile
    (a DPO step of SmolLM2's 49k vocabulary: 30 bytes a tile element), hf_tune's chunked loss about one."""
    from torch.profiler import ProfilerActivity, profile
    from trl.kernels import chunked_logprob

    hidden_size, rows = 64, TRL_PROBE_ROWS
    chunk_size = 32768  # the vocabulary columns of a tile, as TRL's fused head passes them
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        weight = torch.randn(config.vocab_size, hidden_size, dtype=setup.dtype) * 0.02  # frozen: no model state
        hidden = torch.randn(rows, hidden_size, dtype=setup.dtype, requires_grad=True)
        targets = torch.randint(0, config.vocab_size, (rows,))
    with quiet_profiler(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as forward_profile:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=setup.mixed_precision):
            outputs = chunked_logprob.ChunkedLogProbFunction.apply(
                hidden, weight, None, targets, 1.0, chunk_size, None, 1.0, chunked_logprob.OPTIONAL_OUTPUTS)
            loss = -outputs[0].sum() + sum(out.float().sum() * 0 for out in outputs[1:] if out is not None)
    kept, peak = allocations(forward_profile, 0)
    with quiet_profiler(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as backward_profile:
        loss.backward()
        del loss, outputs
    return (max(peak, allocations(backward_profile, kept)[1]) - kept) / rows


