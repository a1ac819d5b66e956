"""The callbacks a run's Trainer hooks feed and the train verb reads, held by name: built where the callbacks are
attached (``hf_tune.assembly.run_build.attach_callbacks``) and handed to the trainer, so that no hook looks a
callback up by its class and a trainer built without them fails clearly instead of silently counting nothing."""

from __future__ import annotations

import dataclasses

from hf_tune.errors import HfTuneError
from hf_tune.evaluation.downstream import DownstreamScores
from hf_tune.trainer.loss_guard import NonFiniteLossGuard
from hf_tune.trainer.mirror import CheckpointMirror
from hf_tune.trainer.rollback import StepSkips
from hf_tune.trainer.throughput import Throughput


@dataclasses.dataclass(frozen=True)
class Monitors:
    """What a run's hooks feed (None: not in this run). ``Monitors()`` runs a hand-built trainer with none of them."""

    loss_guard: NonFiniteLossGuard | None = None  # fed each training loss (HfTuneMixin.compute_loss)
    throughput: Throughput | None = None  # fed each micro-batch (training_step), read by log
    step_skips: StepSkips | None = None  # the steps a rollback skips (training_step, train_with_rollbacks)
    downstream: DownstreamScores | None = None  # lm-eval scores added by evaluation_loop
    mirror: CheckpointMirror | None = None  # its uploads awaited on leaving train (mirror_uploads)


def monitors_of(trainer) -> Monitors:
    """The trainer's monitors; a clear error where it was built without them."""
    monitors = getattr(trainer, "monitors", None)
    if monitors is None:
        raise HfTuneError(f"{type(trainer).__name__} has no monitors: it was built without hf_tune's callbacks, so "
                          "its hooks would count no tokens and guard no loss\n  fix: build it with hf_tune.build_run, "
                          "or call hf_tune.assembly.run_build.attach_callbacks(trainer, recipe) before train(); "
                          "to run without them, set trainer.monitors = hf_tune.trainer.monitors.Monitors()")
    return monitors
