"""Seconds from a preemption signal to the exit of every process, for each launch the tests cover.

    python benchmarks/signal_to_exit.py MODEL_DIR OUT_DIR

Each case starts a real run (``python -m hf_tune.run``, ``torchrun``, ``deepspeed``), waits until step 4's loss is
printed, sends the signal from outside (to the process, to torchrun's agent, or to one rank only) and times until
the launch has exited; then it checks the checkpoint of the step it stopped at is complete and prints one line per
case. The step time and the checkpoint's size say what the grace period must cover.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))
from conftest import chat_recipe, free_port  # noqa: E402

from hf_tune.trainer.checkpoints import last_complete_checkpoint  # noqa: E402

BIN = Path(sys.executable).parent


def recipe(model_dir: str, folder: Path, **training) -> Path:
    raw = chat_recipe(model_dir, folder / "run", max_steps=200, save_strategy="steps", save_steps=100, **training)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def workers(proc: subprocess.Popen) -> list[psutil.Process]:
    """The training processes under a launcher (not torchrun's agent, not DeepSpeed's per-node launcher)."""
    found = []
    for child in psutil.Process(proc.pid).children(recursive=True):
        command = " ".join(child.cmdline())
        if "hf_tune.run" in command and "torchrun" not in command and "deepspeed" not in command:
            found.append(child)
    return sorted(found, key=lambda p: p.pid)


def measure(name: str, command: list[str], run_dir: Path, send) -> dict:
    proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    logged = 0
    for line in proc.stdout:
        logged += "'loss':" in line
        if logged == 4:
            break
    sent = time.perf_counter()
    target = send(proc)
    output = proc.stdout.read()
    proc.wait()
    seconds = time.perf_counter() - sent
    checkpoint = last_complete_checkpoint(run_dir)
    size = sum(p.stat().st_size for p in checkpoint.rglob("*") if p.is_file()) if checkpoint else 0
    return {"case": name, "signalled": target, "exit": proc.returncode, "seconds": round(seconds, 2),
            "checkpoint": checkpoint.name if checkpoint else None, "checkpoint_mb": round(size / 1e6, 1),
            "preempted_lines": output.count("training stopped by a signal")}


def main(model_dir: str, out: Path) -> None:
    cases = []
    single = recipe(model_dir, out / "single")
    cases.append(measure("1 process, SIGTERM", [sys.executable, "-m", "hf_tune.run", str(single)],
                         out / "single" / "run", lambda p: (p.send_signal(signal.SIGTERM), "the process")[1]))
    ddp = recipe(model_dir, out / "torchrun")
    cases.append(measure(
        "torchrun 2 ranks, SIGUSR1 to the agent",
        [str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", str(free_port()), "--signals-to-handle",
         "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1", "--shutdown-timeout", "110", "-m", "hf_tune.run", str(ddp)],
        out / "torchrun" / "run", lambda p: (p.send_signal(signal.SIGUSR1), "torchrun's agent")[1]))
    one = recipe(model_dir, out / "one-rank")
    cases.append(measure(
        "torchrun 2 ranks, SIGTERM to rank 1 only",
        [str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", str(free_port()), "-m", "hf_tune.run",
         str(one)], out / "one-rank" / "run", lambda p: (workers(p)[1].send_signal(signal.SIGTERM), "one worker")[1]))
    zero = recipe(model_dir, out / "zero2", deepspeed="zero2")
    cases.append(measure(
        "deepspeed ZeRO-2 2 ranks, SIGTERM to rank 1 only",
        [str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()), "--module", "hf_tune.run",
         str(zero)], out / "zero2" / "run", lambda p: (workers(p)[1].send_signal(signal.SIGTERM), "one worker")[1]))
    for case in cases:
        print(json.dumps(case))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
