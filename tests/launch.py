"""Every process a test starts, started here and counted: a launch is one command; its interpreter starts are the
Python processes it costs (a launcher and each of its ranks, a CLI, a script), each importing torch and friends. The
totals are printed at the end of a run (``conftest.pytest_terminal_summary``), so a new test's cost shows in review.

Commands name the venv's tools by name (``python``, ``hf-tune``, ``torchrun``, ``accelerate``, ``deepspeed``, ...);
``python`` is this interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
COUNTS: Counter = Counter()  # launches and interpreter starts, by the command's first word
LAUNCHERS = {"torchrun": "--nproc_per_node", "accelerate": "--num_processes", "deepspeed": "--num_gpus"}
NOT_PYTHON = {"git"}
# one CPU thread a rank: two 2-rank launches on 2 cores stay at 2 threads in all (runtime/distributed decides the same)
THREADS = {"OMP_NUM_THREADS": "1"}
# DeepSpeed's CPU ops, built once for every launch of the session (and kept between sessions)
TORCH_EXTENSIONS = {"TORCH_EXTENSIONS_DIR": str(Path.home() / ".cache" / "hf_tune" / "torch_extensions")}


def command(*args: str) -> list[str]:
    """``args`` with its first word resolved: ``python`` to this interpreter, a venv tool to its path."""
    tool, *rest = [str(a) for a in args]
    if tool == "python":
        return [sys.executable, *rest]
    return [str(BIN / tool) if (BIN / tool).exists() else tool, *rest]


def interpreters(args: list[str]) -> int:
    """Python processes a command starts: a launcher and its ranks, or one."""
    tool = Path(args[0]).name
    if tool in NOT_PYTHON:
        return 0
    flag = LAUNCHERS.get(tool)
    if flag and flag in args:
        return 1 + int(args[args.index(flag) + 1])
    if tool == "accelerate" and "launch" in args:
        return 2  # one process unless told otherwise
    return 1


def _count(args: list[str]) -> None:
    name = Path(args[0]).name
    name = "python" if name.startswith("python") else name
    COUNTS[f"launches {name}"] += 1
    COUNTS["launches"] += 1
    COUNTS["interpreter starts"] += interpreters(args)


def environment(env: dict | None = None, threads: bool = False, base: dict | None = None) -> dict:
    """``base`` (default: the test process's environment) with unbuffered output and ``env`` on top; ``threads``:
    one thread a rank."""
    return {**(os.environ if base is None else base), "PYTHONUNBUFFERED": "1", **(THREADS if threads else {}),
            **(env or {})}


def run(*args: str, cwd: Path = REPO, env: dict | None = None, threads: bool = False, timeout: int = 600,
        check: bool = False, capture: bool = True, base_env: dict | None = None) -> subprocess.CompletedProcess:
    """Run a command to its end, its output captured as text. ``env``: variables on top of ``base_env`` (default:
    this process's environment)."""
    full = command(*args)
    _count(full)
    return subprocess.run(full, cwd=cwd, capture_output=capture, text=True, timeout=timeout, check=check,
                          env=environment(env, threads, base_env))


def start(*args: str, cwd: Path = REPO, env: dict | None = None, threads: bool = False, stdout=subprocess.PIPE,
          stderr=subprocess.PIPE, base_env: dict | None = None, **kwargs) -> subprocess.Popen:
    """Start a command (a run to kill, workers side by side); its output piped as text unless told otherwise."""
    full = command(*args)
    _count(full)
    return subprocess.Popen(full, cwd=cwd, stdout=stdout, stderr=stderr, text=True,
                            env=environment(env, threads, base_env), **kwargs)


def torchrun(ranks: int, *args: str) -> list[str]:
    """A torchrun command of ``ranks`` processes on a free port."""
    from conftest import free_port

    return ["torchrun", "--nproc_per_node", str(ranks), "--master_port", str(free_port()), *args]


def deepspeed(ranks: int, *args: str) -> list[str]:
    """A deepspeed launcher command of ``ranks`` processes (CPU ranks on gloo) on a free port."""
    from conftest import free_port

    return ["deepspeed", "--num_gpus", str(ranks), "--master_port", str(free_port()), *args]


def zero(ranks: int, *args: str) -> list[str]:
    """A DeepSpeed run of ``ranks`` processes started by torchrun (``args``: a script and its arguments, or ``-m``
    and a module): the same ranks, environment and ZeRO engine as under the deepspeed launcher, without its own two
    interpreters before the ranks start (about 7 s a launch here). The deepspeed launcher itself runs where it is
    what a test checks (two nodes, a signal to one rank, the wheel's smoke test)."""
    return torchrun(ranks, *args)


def summary() -> str:
    """One line: launches and interpreter starts in all, and launches by command."""
    kinds = ", ".join(f"{key.split(' ', 1)[1]} {n}" for key, n in sorted(COUNTS.items()) if key.startswith("launches "))
    return (f"processes started by tests: {COUNTS['launches']} launches, {COUNTS['interpreter starts']} interpreter "
            f"starts ({kinds or 'none'})")
