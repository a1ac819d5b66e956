"""A trial that a crash left RUNNING is resumed, not restarted: rerunning the study command finds it, and trains it
on from the last complete checkpoint in its folder, under the same trial number and parameters.

Each trial records its worker (host, process id and the process's start time) when it starts. A RUNNING trial whose
worker was on this host and no longer runs is an orphan; the rerun claims it (a file lock in its folder, so two
reruns never both take it), then trains it as the trial loop trains a new one (``search.trials.run_trial``: build,
train, ``study.tell``), since Optuna hands out only new trials. A trial killed on another machine is left to that
machine (with a database storage, Optuna's heartbeat fails it once it is stale).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from contextlib import contextmanager

import optuna

from hf_tune.trainer.checkpoints import last_complete_checkpoint

logger = logging.getLogger(__name__)
RESUME_LOCK = ".hf_tune_resume.lock"


def this_worker() -> dict:
    """Who runs a trial: host, process id and the process's start time (a reused pid is another process)."""
    import psutil

    return {"host": socket.gethostname(), "pid": os.getpid(),
            "started": round(psutil.Process().create_time(), 2)}


def worker_is_gone(worker: dict | None) -> bool:
    """True for a worker of this host whose process no longer runs; False where it runs, or is unknown/elsewhere."""
    import psutil

    if not worker or worker.get("host") != socket.gethostname():
        return False
    try:
        return round(psutil.Process(worker["pid"]).create_time(), 2) != worker["started"]
    except (psutil.NoSuchProcess, psutil.AccessDenied, KeyError):
        return True


def orphaned_trials(study) -> list:
    """RUNNING trials whose worker on this host is gone (killed: SIGKILL, OOM killer, power)."""
    running = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
    return [t for t in running if worker_is_gone(t.user_attrs.get("worker"))]


def claimed_orphans(study, storage, folder_of):
    """The orphaned trials of the study, one at a time, each while the resume lock in its folder (``folder_of(trial)``)
    is held, so that two reruns never both take it."""
    from filelock import FileLock, Timeout

    for frozen in orphaned_trials(study):
        folder = folder_of(frozen)
        folder.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(folder / RESUME_LOCK))
        try:
            lock.acquire(timeout=0)
        except Timeout:  # another rerun took it
            continue
        try:
            now = storage.get_trial(frozen._trial_id)  # as it is now that the lock is held
            if now.state == optuna.trial.TrialState.RUNNING and worker_is_gone(now.user_attrs.get("worker")):
                yield now
        finally:
            lock.release()


def resume_orphaned_trials(study, storage, folder_of, train) -> list[int]:
    """Resume every orphaned trial of the study in turn, each by ``train(trial, checkpoint)`` (the trial loop's own
    ``run_trial``, which tells Optuna how it ended) from its last complete checkpoint in ``folder_of(trial)`` (from
    the start when it saved none); returns their numbers."""
    resumed = []
    for frozen in claimed_orphans(study, storage, folder_of):
        trial = optuna.trial.Trial(study, frozen._trial_id)
        checkpoint = last_complete_checkpoint(folder_of(frozen))
        trial.set_user_attr("worker", this_worker())
        trial.set_user_attr("resumed_from", checkpoint.name if checkpoint else None)
        logger.info("search: trial %d was left running by a worker that is gone; resuming it from %s with %s",
                    frozen.number, checkpoint or "its start (no complete checkpoint)", frozen.params)
        with heartbeat(storage, frozen._trial_id):
            train(trial, str(checkpoint) if checkpoint else None)
        resumed.append(frozen.number)
    return resumed


@contextmanager
def heartbeat(storage, trial_id: int):
    """Record the trial's heartbeat while it trains (database storages), as Optuna does for the trials it runs, so
    no other worker fails it as stale."""
    enabled = getattr(storage, "is_heartbeat_enabled", lambda: False)()
    if not enabled:
        yield
        return
    stop = threading.Event()

    def beat() -> None:
        while True:
            storage.record_heartbeat(trial_id)
            if stop.wait(storage.get_heartbeat_interval()):
                return

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
