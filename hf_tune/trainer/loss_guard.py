"""The NaN guard: a non-finite training loss stops the run on every rank, before any checkpoint holds its weights.

Each micro-step only ORs "this loss is not finite" into a flag on the loss's device (the first such step is kept
there too): no host sync and no collective in the hot path. The flag is read, and gathered across ranks, where the
host waits anyway and before anything is written: at every log, evaluation and save, and at the end of training.
The steps between the NaN and that point are wasted, but a checkpoint never holds them.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import TrainerCallback

from hf_tune.trainer.checkpoints import NonFiniteLoss, last_complete_checkpoint


class NonFiniteLossGuard(TrainerCallback):
    """Fed each training loss by ``HfTuneMixin.compute_loss``; raises ``NonFiniteLoss`` on every rank at once (all
    of them check at the same points, so none is left waiting in a collective)."""

    def __init__(self):
        self.first_bad_step: torch.Tensor | None = None  # on the loss's device; 0 while every loss was finite
        self.first_bad_loss: torch.Tensor | None = None

    def add(self, loss: torch.Tensor, step: int) -> None:
        """Record ``loss`` of optimizer step ``step`` (1-based) without reading it on the host."""
        loss = loss.detach()
        if self.first_bad_step is None:
            self.first_bad_step = torch.zeros((), dtype=torch.long, device=loss.device)
            self.first_bad_loss = torch.zeros((), dtype=torch.float32, device=loss.device)
        loss = loss.to(self.first_bad_step.device)  # a model split over devices: kept where the first loss was
        first = torch.isfinite(loss).all().logical_not() & self.first_bad_step.eq(0)
        self.first_bad_step = torch.where(first, step, self.first_bad_step)
        self.first_bad_loss = torch.where(first, loss.float().mean(), self.first_bad_loss)

    def check(self, args) -> None:
        """Raise on every rank if any rank has seen a non-finite loss (every rank must call this)."""
        mine = self.first_bad_step if self.first_bad_step is not None else torch.zeros((), dtype=torch.long)
        distributed = args.world_size > 1
        if distributed:
            from accelerate.utils import gather

            steps = gather(mine.to(args.device).reshape(1)).tolist()
        else:
            steps = [int(mine)]
        bad = [step for step in steps if step]
        if not bad:
            return
        first = min(bad)
        ranks = [rank for rank, step in enumerate(steps) if step == first]
        value = float(self.first_bad_loss) if int(mine) == first else None
        last = last_complete_checkpoint(Path(args.output_dir))
        error = NonFiniteLoss(
            f"training stopped: the loss at step {first} is "
            + (f"not finite on rank(s) {ranks} (this rank's: {'finite' if value is None else value})" if distributed
               else f"{value} (not finite)")
            + f"\n  last good checkpoint: {last or 'none yet'}\n"
            "  fix: lower training.learning_rate, set training.max_grad_norm, check the data; rerunning the same "
            "command resumes from the last good checkpoint, or set resilience.rollback_on_nonfinite")
        error.step = first  # every rank: the same step (resilience.rollback_on_nonfinite skips it)
        raise error

    def on_train_begin(self, args, state, control, **kwargs):
        self.first_bad_step = self.first_bad_loss = None  # each train() (a search trial) starts clean

    def on_step_end(self, args, state, control, **kwargs):
        if control.should_log or control.should_evaluate or control.should_save or control.should_training_stop:
            self.check(args)

    on_epoch_end = on_step_end  # epoch-strategy logs, evaluations and saves are decided there

    def on_train_end(self, args, state, control, **kwargs):
        self.check(args)  # before the final model is saved
