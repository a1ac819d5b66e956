"""The ranges of the verbs' numeric options, as argparse types: a value out of range ends in argparse's own error
(``hf-tune VERB: error: argument --FLAG: ...``, exit status 2, no traceback) before anything loads or is written,
as strict as the recipe's checks. A plausible unit mistake is named with its fix (GPU memory given in MiB)."""

from __future__ import annotations

import argparse
import math

MAX_GPU_MEMORY_GB = 1024  # above any accelerator's memory; a figure past it is a unit mistake (MiB given as GB)


def whole(low: int, high: int | None = None):
    """A whole number in ``[low, high]``."""
    def convert(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
        if value < low or (high is not None and value > high):
            bounds = f"from {low} to {high}" if high is not None else f"{low} or more"
            raise argparse.ArgumentTypeError(f"must be {bounds}, got {value}")
        return value
    return convert


def number(low: float, high: float | None = None, low_open: bool = False):
    """A finite number at least ``low`` (above it, with ``low_open``) and at most ``high``."""
    def convert(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
        below = value <= low if low_open else value < low
        if not math.isfinite(value) or below or (high is not None and value > high):
            bounds = f"{'above' if low_open else 'at least'} {low:g}" + (f" and at most {high:g}" if high else "")
            raise argparse.ArgumentTypeError(f"must be {bounds}, got {text}")
        return value
    return convert


def gpu_memory_gb(text: str) -> float:
    """GB of memory per GPU: above 0 and at most ``MAX_GPU_MEMORY_GB``; a figure in MiB is named as such."""
    value = number(0, low_open=True)(text)
    if value > MAX_GPU_MEMORY_GB:
        raise argparse.ArgumentTypeError(
            f"{text} GB is more than any GPU holds; if that is MiB, it is {value / 1024:g} GB: "
            f"--gpu-memory {value / 1024:g}")
    return value


__all__ = ["gpu_memory_gb", "number", "whole"]


def device_here(text: str) -> str:
    """A torch device this machine has: ``cpu``, ``cuda`` / ``cuda:N`` where CUDA sees that card, ``mps`` where
    Metal is there. Checked before a model loads or a server starts (a server on a missing device started, then
    failed at its first request)."""
    import torch

    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a torch device (cpu, cuda, cuda:0, mps)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text}: this machine has no CUDA device torch can use (fix: leave --device "
                                         "out to use what there is, or --device cpu)")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"{text}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                                         f"numbered from 0")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise argparse.ArgumentTypeError(f"{text}: Metal (mps) is not available here (fix: --device cpu)")
    return text
