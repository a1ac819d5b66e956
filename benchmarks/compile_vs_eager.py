"""torch.compile against eager on hf_tune's packed, flattened sdpa_varlen batches, side by side in one run.

    flock -x /tmp/hf_tune_cpu.lock python benchmarks/compile_vs_eager.py [--steps 20]

Each setup is ``python -m hf_tune.run recipes/llm_lora.yaml`` (SmolLM2-135M + LoRA, the demo chats in packs of up to
1,024 tokens) in its own process, eager first, then ``training.torch_compile=true`` (torch's automatic dynamic
shapes: a dimension is made dynamic once it has changed), then the same with every dimension dynamic from the start
(``ACCELERATE_DYNAMO_USE_DYNAMIC=1``, accelerate's switch for ``torch.compile(dynamic=True)``), logging every step.
Reported:
real tokens/s over the steps after the compiled run's last (re)compilation (steady state) and over the whole run,
and the compile time: the compiled run's extra seconds in its compiling steps over the eager run's median step.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WARM = 3  # steps that (re)compile under automatic dynamic shapes: the first, then a changed length and count


def run(out: Path, steps: int, compile_: bool, dynamic: bool = False) -> list[dict]:
    import os

    command = [sys.executable, "-m", "hf_tune.run", "recipes/llm_lora.yaml", f"training.output_dir={out}",
               f"training.max_steps={steps}", "training.save_strategy=no", "training.eval_strategy=no",
               "training.logging_steps=1", "data.eval_split=null", f"training.torch_compile={str(compile_).lower()}"]
    env = {**os.environ, **({"ACCELERATE_DYNAMO_USE_DYNAMIC": "1"} if dynamic else {})}
    subprocess.run(command, cwd=ROOT, check=True, capture_output=True, text=True, env=env)
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    return [entry for entry in history if "step_time" in entry and "loss" in entry]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="compile-bench-") as work:
        eager = run(Path(work) / "eager", args.steps, False)
        compiled = run(Path(work) / "compiled", args.steps, True)
        dynamic = run(Path(work) / "dynamic", args.steps, True, dynamic=True)
    median_eager = statistics.median(e["step_time"] for e in eager)

    def compile_seconds(entries, warm):
        return sum(e["step_time"] - median_eager for e in entries[:warm])

    def rate(entries):
        return sum(e["tokens_per_second"] * e["step_time"] for e in entries) / sum(e["step_time"] for e in entries)

    print(f"Command: `flock -x /tmp/hf_tune_cpu.lock python benchmarks/compile_vs_eager.py --steps {args.steps}`  ")
    print(f"Date: {datetime.date.today()}; machine: {platform.machine()}, no GPU.\n")
    print("| setup | tok/s, steps 4+ | tok/s, whole run | compile time s |")
    print("|---|---|---|---|")
    print(f"| eager | {rate(eager[WARM:]):.0f} | {rate(eager):.0f} | |")
    print(f"| torch.compile (inductor), automatic dynamic shapes | {rate(compiled[WARM:]):.0f} | "
          f"{rate(compiled):.0f} | {compile_seconds(compiled, WARM):.0f} |")
    print(f"| torch.compile (inductor), dynamic=True | {rate(dynamic[WARM:]):.0f} | {rate(dynamic):.0f} | "
          f"{compile_seconds(dynamic, 1):.0f} |")
    for name, entries in (("eager", eager), ("compiled", compiled), ("dynamic=True", dynamic)):
        print(f"\nstep times (s), {name}:", [round(e["step_time"], 2) for e in entries])


if __name__ == "__main__":
    main()
