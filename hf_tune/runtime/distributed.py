"""Refuse runs where the launcher meant several processes but training is not actually distributed: each process
would otherwise train its own copy of the model and exit 0 (measured on CPU for torchrun without ``use_cpu``, and
for ``accelerate launch --num_processes 2`` without ``--multi_gpu``, which starts one process)."""

from __future__ import annotations

import os

from hf_tune.errors import HfTuneError


def accelerator_available() -> bool:
    import torch

    return bool(torch.accelerator.is_available()) if hasattr(torch, "accelerator") else torch.cuda.is_available()


def _world():
    """(rank, world size) of the initialised process group, else (0, 1)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def wait_for_every_rank() -> None:
    """A barrier of the initialised process group (nothing alone): what every rank wrote before it is on disk."""
    import torch.distributed as dist

    if _world()[1] > 1:
        dist.barrier()


def decided_on_main(decide):
    """``decide()`` run on the main process only, its result (or its error) given to every process.

    What each rank would read from a shared folder itself can differ (a stale NFS view, node-local disks, a file the
    main process writes meanwhile), and ranks that disagree train apart or wait in a collective forever."""
    import torch.distributed as dist

    rank, world = _world()
    if world == 1:
        return decide()
    box: list = [None]
    if rank == 0:
        try:
            box[0] = (decide(), None)
        except HfTuneError as err:
            box[0] = (None, err)
        except Exception as err:  # not picklable in general: the others get its text, the main process the error
            dist.broadcast_object_list([(None, HfTuneError(f"on the main process: {type(err).__name__}: {err}"))],
                                       src=0)
            raise
    dist.broadcast_object_list(box, src=0)
    result, error = box[0]
    if error is not None:
        raise error
    return result


def ranks_without(path, check) -> list[int]:
    """The ranks where ``check(path)`` fails (every rank must call this)."""
    import torch.distributed as dist

    _, world = _world()
    mine = check(path)
    seen = [mine]
    if world > 1:
        seen = [None] * world
        dist.all_gather_object(seen, mine)
    return [r for r, ok in enumerate(seen) if not ok]


def _accelerate_processes_asked() -> int:
    """--num_processes of an ``accelerate launch`` that started this process directly, else 1."""
    try:
        import psutil

        command = psutil.Process(os.getppid()).cmdline()
    except Exception:  # no parent to read: nothing to check
        return 1
    if not any(part.endswith("accelerate") for part in command[:2]) or "launch" not in command:
        return 1
    for i, part in enumerate(command):
        for flag in ("--num_processes", "--num-processes"):
            if part == flag and i + 1 < len(command) and command[i + 1].isdigit():
                return int(command[i + 1])
            if part.startswith(flag + "="):
                return int(part.split("=", 1)[1])
    return 1


def check_distributed(args) -> None:
    if args.fsdp and args.device.type == "cpu":
        raise HfTuneError(
            "training.fsdp is set but this run is on CPU, where accelerate replaces FSDP with plain data parallelism "
            "without saying so: nothing would be sharded\n"
            "  fix: run FSDP on GPUs; on CPU shard with DeepSpeed ZeRO-3 (training.deepspeed: zero3), or remove "
            "training.fsdp")
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > 1 and args.world_size != launched:
        raise HfTuneError(
            f"the launcher started {launched} processes (WORLD_SIZE={launched}) but this one trains alone "
            f"(world size {args.world_size}): every process would train its own model\n"
            "  fix: on a machine without GPUs keep training.use_cpu: true (the default there); with GPUs check that "
            "each process sees its own device")
    asked = _accelerate_processes_asked()
    if asked > 1 and "WORLD_SIZE" not in os.environ:
        raise HfTuneError(
            f"accelerate launch was asked for {asked} processes but started only this one (its single-process "
            "launcher), so nothing would be distributed\n"
            f"  fix: accelerate launch --multi_gpu --num_processes {asked} -m hf_tune.run ... (also on CPU), "
            f"or torchrun --nproc_per_node {asked} -m hf_tune.run ...")


LAUNCHERS = ("accelerate", "torchrun", "torch.distributed.run", "torch.distributed.launch")


def _launcher_forced_one_thread() -> bool:
    """Whether OMP_NUM_THREADS=1 came from a launcher rather than the user: ``accelerate launch`` (without ``--cpu``
    or ``--num_cpu_threads_per_process``) and ``torchrun`` set it for their children when their own environment has
    none. A parent that cannot be read counts as the user's choice."""
    if os.environ.get("OMP_NUM_THREADS") != "1":
        return False
    try:
        import psutil

        parent = psutil.Process(os.getppid())
        command, environ = parent.cmdline(), parent.environ()
    except Exception:  # no parent to read (or not ours): leave the setting alone
        return False
    launcher = " ".join(command[:3])
    if "OMP_NUM_THREADS" in environ or not any(name in launcher for name in LAUNCHERS):
        return False
    flags = ("--num_cpu_threads_per_process", "--num-cpu-threads-per-process")
    return not any(part.startswith(flags) for part in command)


def fit_cpu_threads(args) -> int:
    """On CPU, undo a launcher's one-thread default: use the physical cores of this node divided by its processes.
    A thread count the user chose (OMP_NUM_THREADS, ``--num_cpu_threads_per_process``) is kept. Returns the count."""
    import logging

    import torch

    if args.device.type != "cpu" or not _launcher_forced_one_thread():
        return torch.get_num_threads()
    import psutil

    cores = psutil.cpu_count(logical=False) or os.cpu_count() or 1
    if hasattr(os, "sched_getaffinity"):
        cores = min(cores, len(os.sched_getaffinity(0)))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    threads = max(cores // local, 1)
    torch.set_num_threads(threads)
    logging.getLogger("hf_tune").info(
        "CPU threads: %d per process (%d physical cores / %d process(es) on this node); the launcher had set "
        "OMP_NUM_THREADS=1. Set OMP_NUM_THREADS or --num_cpu_threads_per_process to choose.", threads, cores, local)
    return threads


END_BARRIER_TIMEOUT_S = 300


def end_process_group(timeout_s: float = END_BARRIER_TIMEOUT_S) -> None:
    """At the end of a launch that succeeded, the ranks wait for each other, then each closes its process group.

    Without the wait, the first rank to exit closes its sockets while a slower one still holds its group (writing the
    model, the manifest, a study's summary), and gloo's I/O thread there aborts the process ("terminate called without
    an active exception": exit -6 after a complete run, and the other node's launcher waits 300 s at its exit
    barrier; seen under torchrun, one node a rank). The wait is bounded: on gloo by ``monitored_barrier``, which
    names the ranks that never came (a rank that failed exits through its error and never gets here); the launcher
    ends the others then."""
    import datetime
    import logging

    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    if dist.get_world_size() > 1:
        try:
            if dist.get_backend() == "gloo":
                dist.monitored_barrier(timeout=datetime.timedelta(seconds=timeout_s), wait_all_ranks=True)
            else:
                dist.barrier()
        except RuntimeError as err:  # a rank that never came: close this one's group anyway
            logging.getLogger("hf_tune").warning("the ranks did not all reach the end of the run: %s", err)
    dist.destroy_process_group()
