"""What each interpreter the suite (or a launcher) starts pays before its first step: ``import hf_tune.run`` and the
build, with hf_tune's bytecode written beforehand (``make test`` runs ``compileall``) and without it, where
``PYTHONDONTWRITEBYTECODE`` is set (as on CI) so that every interpreter compiles hf_tune's modules again. Two copies
of the package side by side, the starts alternated, the median of each.

    python benchmarks/interpreter_start.py [--runs 7]
"""

from __future__ import annotations

import argparse
import compileall
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
IMPORTS = "import hf_tune.run, hf_tune.assembly.run_build"


def start(root: Path) -> float:
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": str(root)}
    began = time.perf_counter()
    subprocess.run([sys.executable, "-c", IMPORTS], cwd=root, env=env, check=True, capture_output=True)
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    runs = parser.parse_args().runs
    with tempfile.TemporaryDirectory() as scratch:
        copies = {name: Path(scratch) / name for name in ("bytecode", "source only")}
        for root in copies.values():
            shutil.copytree(REPO / "hf_tune", root / "hf_tune", ignore=shutil.ignore_patterns("__pycache__"))
        compileall.compile_dir(copies["bytecode"] / "hf_tune", quiet=1)
        for root in copies.values():  # each start imports its own copy, not the installed package
            found = subprocess.run([sys.executable, "-c", "import hf_tune; print(hf_tune.__file__)"], cwd=root,
                                   env={**os.environ, "PYTHONPATH": str(root)}, capture_output=True, text=True)
            assert found.stdout.strip().startswith(str(root)), found.stdout
        start(copies["bytecode"])  # the library's own pages into the OS cache, for both
        times = {name: [] for name in copies}
        for _ in range(runs):
            for name, root in copies.items():
                times[name].append(start(root))
    median = {name: statistics.median(values) for name, values in times.items()}
    for name, value in median.items():
        print(f"{name:12s} median {value:.2f} s over {runs} starts ({', '.join(f'{v:.2f}' for v in times[name])})")
    print(f"saved per interpreter: {median['source only'] - median['bytecode']:.2f} s "
          f"({median['bytecode'] / median['source only']:.3f} of the time)")


if __name__ == "__main__":
    main()
