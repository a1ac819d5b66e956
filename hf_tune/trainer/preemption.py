"""Save on a signal: SIGTERM or SIGUSR1 (SLURM's ``--signal``) ends the run with a complete checkpoint of the step
in progress, then ``Preempted`` (exit status ``EXIT_PREEMPTED``); rerunning the same command resumes from it.

The signal handler only raises a flag. At the end of every optimizer step the ranks agree on it (one 4-byte
all-reduce over a CPU (gloo) group: no device sync), so a signal that reaches one rank stops all of them at the same
step, and every rank takes part in the save (DDP, DeepSpeed ZeRO). The save is Trainer's own periodic save
(``control.should_save``), so the completeness marker is written as for any checkpoint; once it is,
``Preempted`` is raised on every rank, before anything marks the run finished.

This is hf_tune's implementation of ``training.enable_jit_checkpoint`` (upstream's key and meaning). Upstream's
callback is not used: it handles SIGTERM only, waits 3 s before asking, lets each rank decide alone (a rank
signalled alone saves or stops while the others wait in a collective), and saves through the private
``Trainer._save_checkpoint`` without the ``on_save`` event that writes our marker.
"""

from __future__ import annotations

import logging
import signal
import threading

import torch
from transformers import TrainerCallback

from hf_tune.errors import EXIT_PREEMPTED, HfTuneError

logger = logging.getLogger(__name__)
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preempted(HfTuneError):
    """Training stopped on a signal after saving a complete checkpoint; the run is not finished."""

    exit_code = EXIT_PREEMPTED


class SaveOnSignal(TrainerCallback):
    """On SIGTERM / SIGUSR1: save a checkpoint of the current step on every rank, then raise ``Preempted``."""

    def __init__(self):
        self.received: int | None = None  # the signal this process got (set by the handler, read at step ends)
        self.stop_step: int | None = None  # the step every rank agreed to save and stop at
        self._previous: dict[int, object] = {}
        self._group = None

    def _handle(self, signum, frame):  # only a flag: logging here could deadlock on the logging lock
        if self.received is None:
            self.received = signum

    def on_train_begin(self, args, state, control, **kwargs):
        self.stop_step = None
        if self._group is None:
            self._group = _flag_group(args)
        if threading.current_thread() is not threading.main_thread():
            logger.warning("training.enable_jit_checkpoint: not in the main thread, where signals are handled; "
                           "a SIGTERM will not save a checkpoint")
            return
        if self._previous:  # still ours: train() again after an exception (a rollback), a signal kept
            return
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)

    def on_step_end(self, args, state, control, **kwargs):
        signalled = _agree(self.received is not None, self._group)
        if not signalled:
            return
        self.stop_step = state.global_step
        name = signal.Signals(self.received).name if self.received else "a signal on another rank"
        logger.warning("%s received: saving checkpoint-%d and stopping", name, state.global_step)
        control.should_save = True
        control.should_training_stop = True

    def on_save(self, args, state, control, **kwargs):
        if self.stop_step is None or state.global_step != self.stop_step:
            return
        self._restore()
        raise Preempted(f"training stopped by a signal at step {state.global_step} of {state.max_steps}: "
                        f"checkpoint-{state.global_step} is saved and complete; the run is not finished\n"
                        "  fix: rerun the same command to resume from it (training.resume_from_checkpoint: auto)")

    def on_train_end(self, args, state, control, **kwargs):
        self._restore()

    def _restore(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}


def _flag_group(args):
    """The process group the stop flag is all-reduced over: None alone; the default group when it is gloo, else a
    gloo group of every rank (a host flag needs no device copy and no device sync)."""
    import torch.distributed as dist

    if args.world_size <= 1 or not (dist.is_available() and dist.is_initialized()):
        return None
    if dist.get_backend() == "gloo":
        return dist.group.WORLD
    return dist.new_group(backend="gloo")  # every rank calls on_train_begin, as new_group requires


def _agree(mine: bool, group) -> bool:
    """Whether any rank was signalled (every rank must call this at the same step)."""
    if group is None:
        return mine
    import torch.distributed as dist

    flag = torch.tensor([int(mine)], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())


def saves_on_signal(recipe) -> bool:
    """``training.enable_jit_checkpoint``, on unless the recipe turns it off (upstream's default is off)."""
    return bool(recipe.training.get("enable_jit_checkpoint", True))
