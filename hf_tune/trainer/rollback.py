"""Roll back instead of dying (``resilience.rollback_on_nonfinite``): a non-finite loss or gradient reloads the last
complete checkpoint, skips the optimizer step whose batches gave it, and training goes on.

The NaN guard (``loss_guard.py``, fed each loss and, here, each step's gradient norm) raises ``NonFiniteLoss`` on every
rank with the first bad step S, before anything of it is logged or saved. ``train_with_rollbacks`` catches it and calls
Trainer's public ``train(resume_from_checkpoint=<last complete checkpoint>)`` again, on the same trainer: weights,
optimizer, scheduler, RNG states and the data position come back from the checkpoint, so steps up to S - 1 replay
exactly. At step S, ``HfTuneMixin.training_step`` asks ``StepSkips`` and returns a zero loss for each of that step's
micro-batches without a forward or backward pass: no gradient exists, so the optimizer updates nothing (torch's
optimizers pass over parameters without a gradient: weights and moments stay as they were), while the scheduler and the
data move on by one step. The skipped batches are thus left out and every other batch keeps its place in the data order.
Each rollback is logged and kept in ``run.json`` (``rollbacks``: the step, the checkpoint reloaded, each skipped
micro-batch's sequences, tokens and the sha256 of its token ids, this rank's).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import TrainerCallback

from hf_tune import run_folder
from hf_tune.runtime.distributed import decided_on_main
from hf_tune.trainer.checkpoints import NonFiniteLoss, last_complete_checkpoint
from hf_tune.trainer.loss_guard import NonFiniteLossGuard

logger = logging.getLogger(__name__)


class StepSkips(TrainerCallback):
    """The optimizer steps whose batches are skipped (1-based global steps), and what was skipped. A callback handed
    to the trainer's hooks in its monitors (``HfTuneMixin.training_step``), like the NaN guard. Before each optimizer
    step it feeds the gradients' total norm to the NaN guard (on the device, no host sync), so that a non-finite
    gradient under a finite loss rolls back too, and at its own step."""

    def __init__(self, guard: NonFiniteLossGuard | None = None, steps: set[int] | None = None):
        self.guard = guard
        self.steps: set[int] = set(steps or ())
        self.skipped: list[dict] = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if self.guard is None or model is None:
            return
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if grads:  # this rank's gradients: all of them under DDP (averaged), its shards under FSDP
            self.guard.add(torch.nn.utils.get_total_norm(grads), state.global_step + 1)

    def skips(self, step: int) -> bool:
        return step in self.steps

    def skip(self, step: int, inputs, device) -> torch.Tensor:
        """Record a micro-batch of ``step`` as skipped; its loss (zero, with no graph: nothing is back-propagated)."""
        ids = inputs.get("input_ids") if hasattr(inputs, "get") else None
        record = {"step": step, "micro_batch": sum(1 for r in self.skipped if r["step"] == step)}
        if isinstance(ids, torch.Tensor):
            positions = inputs.get("position_ids")
            record["sequences"] = int((positions == 0).sum()) if isinstance(positions, torch.Tensor) \
                else int(ids.shape[0])
            mask = inputs.get("attention_mask")
            record["tokens"] = int(mask.sum()) if isinstance(mask, torch.Tensor) else int(ids.numel())
            record["input_ids_sha256"] = hashlib.sha256(ids.detach().cpu().numpy().tobytes()).hexdigest()
        self.skipped.append(record)
        logger.warning("Skipping micro-batch %d of step %d (it gave a non-finite loss before the rollback)",
                       record["micro_batch"], step)
        return torch.zeros((), device=device)


def train_with_rollbacks(trainer, resume: str | None, limit: int, rollbacks: list[dict], skips: StepSkips | None,
                         on_rollback: Callable[[list[dict]], None] = lambda _: None):
    """``trainer.train``, rolled back to the last complete checkpoint at a non-finite loss, at most ``limit`` times
    in all (``rollbacks``: those of earlier launches of this run, from run.json, extended here; ``skips``: the
    trainer's step skips, None without rollbacks). Every rank calls it and takes the main process's choice of
    checkpoint."""
    if skips is not None:
        skips.steps.update(r["step"] for r in rollbacks)
    while True:
        try:
            return trainer.train(resume_from_checkpoint=resume)
        except NonFiniteLoss as err:
            if skips is None or err.step is None or len(rollbacks) >= limit:
                if limit and len(rollbacks) >= limit:
                    logger.error("resilience.rollback_on_nonfinite: all %d rollback(s) used", limit)
                raise
            output_dir = Path(trainer.args.output_dir)
            last = decided_on_main(lambda: _name(last_complete_checkpoint(output_dir)))
            if last is None:
                raise NonFiniteLoss(f"{err}\n  no rollback: no complete checkpoint was written before step "
                                    f"{err.step} (resilience.rollback_on_nonfinite needs one: save more often)") \
                    from None
            skips.steps.add(err.step)
            rollbacks.append({"step": err.step, "checkpoint": last, "error": str(err).splitlines()[0]})
            logger.warning("Rollback %d of %d: %s; reloading %s and skipping the batches of step %d",
                           len(rollbacks), limit, str(err).splitlines()[0], last, err.step)
            on_rollback(rollbacks)
            resume = str(output_dir / last)
            trainer.optimizer = None  # built again, then loaded from the checkpoint (never wrapped twice)


def skipped_batches(rollbacks: list[dict], skips: StepSkips | None) -> list[dict]:
    """``rollbacks`` with the micro-batches skipped at each one's step (``skipped_batches``)."""
    if skips is None:
        return rollbacks
    return [{**r, "skipped_batches": [s for s in skips.skipped if s["step"] == r["step"]] or
             r.get("skipped_batches", [])} for r in rollbacks]


def _name(checkpoint: Path | None) -> str | None:
    return checkpoint.name if checkpoint is not None else None


def earlier_rollbacks(output_dir: Path) -> list[dict]:
    """The rollbacks of earlier launches of this run (``run.json``), so a resumed run keeps skipping their steps and
    counts them against the limit."""
    try:
        return list(json.loads((output_dir / run_folder.MANIFEST).read_text()).get("rollbacks") or [])
    except (OSError, ValueError, AttributeError):
        return []
