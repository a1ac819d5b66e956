"""The random-number generators a run seeded are the training's alone: whatever hf_tune does beside a training step
(an evaluation, its data loaders, generation samples and downstream tasks, a measurement) runs with them kept, so a
run's result does not depend on how often it evaluated or on what a cache held (a peak-FLOP/s measurement drawing
from the seeded generator changed every later dropout mask of a new user's first run)."""

from __future__ import annotations

import contextlib
import random

import numpy as np
import torch


@contextlib.contextmanager
def generators_kept():
    """Run the block, then put back the global generators as they were before it: torch's CPU generator and every
    CUDA device's (``torch.random.fork_rng``), Python's ``random`` and NumPy's legacy global state (lm-eval seeds
    all three)."""
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    python_state, numpy_state = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)
