"""LoRA dropout with a cheaper mask on CPU.

PEFT applies ``nn.Dropout`` to the input of every LoRA layer, and on CPU drawing its mask (``bernoulli_``, one
Mersenne-Twister draw per element) was a large share of a SmolLM2 LoRA step (profiled: docs/speed.md). ``FastDropout``
draws 16 random bits per element instead, four per 64-bit draw, and keeps an element when its bits clear a threshold:
the same inverted dropout with a drop probability rounded to 1/65,536 (the scale uses the rounded value, so the
expectation is exact). On accelerators ``F.dropout`` is already a fused kernel and is used as it is.
"""

from __future__ import annotations

import torch
from torch import nn

RESOLUTION = 1 << 16


class FastDropout(nn.Module):
    """Inverted dropout: zeroes each element with probability ``round(p * 65536) / 65536`` while training and scales
    the rest so the expectation is unchanged; draws from torch's default generator, so seeds and checkpointed RNG
    states make it reproducible."""

    def __init__(self, p: float):
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability must be in [0, 1), got {p}")
        self.p = p
        self.drop_threshold = round(p * RESOLUTION)
        self.drop_probability = self.drop_threshold / RESOLUTION

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.drop_threshold == 0:
            return x
        if x.device.type != "cpu":
            return nn.functional.dropout(x, self.p, training=True)
        return _MaskedScale.apply(x, self.drop_threshold - RESOLUTION // 2, 1.0 / (1.0 - self.drop_probability))

    def extra_repr(self) -> str:
        return f"p={self.p}"


class _MaskedScale(torch.autograd.Function):
    """``x * keep * scale`` with ``keep`` drawn here; saves only the boolean mask. One ``where`` and one in-place
    scale each way: less time forward + backward than the same ops under autograd (measured: docs/speed.md)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, threshold: int, scale: float) -> torch.Tensor:
        n = x.numel()
        words = torch.empty((n + 3) // 4, dtype=torch.int64).random_(-(2**63), None)  # the full 64-bit range
        bits = words.view(torch.int16)[:n].view(x.shape)  # uniform over [-32768, 32767]
        keep = bits >= threshold
        ctx.save_for_backward(keep)
        ctx.scale = scale
        return torch.where(keep, x, 0.0).mul_(scale)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (keep,) = ctx.saved_tensors
        return torch.where(keep, grad, 0.0).mul_(ctx.scale), None, None


def use_fast_lora_dropout(model: nn.Module) -> int:
    """Swap the ``nn.Dropout`` of every PEFT LoRA layer for ``FastDropout`` with the same ``p``; returns how many.
    Adapter weights and saved files are unchanged (dropout has no state)."""
    swapped = 0
    for module in list(model.modules()):
        dropouts = getattr(module, "lora_dropout", None)
        if not isinstance(dropouts, nn.ModuleDict):
            continue
        for name, dropout in dropouts.items():
            if type(dropout) is nn.Dropout:
                dropouts[name] = FastDropout(dropout.p).train(dropout.training)
                swapped += 1
    return swapped
