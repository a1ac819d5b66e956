"""Finding a trainer's callback by its class: a leaf of ``trainer/`` that the hooks, the rollback loop, the mirror and
the train verb all use (the hooks import the rollback module, so it cannot live in the hooks)."""

from __future__ import annotations

from typing import TypeVar

from transformers import Trainer

C = TypeVar("C")


def callback_of(trainer: Trainer, kind: type[C]) -> C | None:
    """The trainer's callback of class ``kind``, or None."""
    return next((c for c in trainer.callback_handler.callbacks if isinstance(c, kind)), None)
