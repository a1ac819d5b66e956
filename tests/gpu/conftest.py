"""The GPU suite (``make test-gpu``): every test here is marked ``gpu`` and skipped where CUDA is unavailable, so the
default ``make test`` collects and skips it cleanly."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)  # before `-m gpu` selects on the marker
def pytest_collection_modifyitems(config, items):
    import torch

    skip = pytest.mark.skip(reason="needs a CUDA GPU (the GPU suite: make test-gpu)")
    for item in items:
        if HERE in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(skip)
