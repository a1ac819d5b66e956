"""QLoRA (4-bit nf4 base) against fp32 LoRA: the same recipe but for the base's weights, side by side in one run.

    flock -x /tmp/hf_tune_cpu.lock python benchmarks/qlora_vs_lora.py [--steps 20] [--repeat 1]

Each setup is ``python -m hf_tune.run`` in its own process (so its peak RSS is its own), one at a time, alternating
when repeated: recipes/llm_lora.yaml and recipes/llm_qlora.yaml with the same data, steps, seed and LoRA. Reported
from each run folder: real tokens/s and peak memory over training (train_results.json), held-out loss on the
recipes' 5 % eval split (eval_results.json), and the base's weight bytes as loaded (hf_tune.model.quantization).
A third setup adds gradient checkpointing, which peft's prepare_model_for_kbit_training turns on by default and
hf_tune leaves to training.gradient_checkpointing.
Prints a Markdown table for benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SETUPS = {"fp32 LoRA (recipes/llm_lora.yaml)": ("recipes/llm_lora.yaml",),
          "QLoRA nf4 + double quant, compute fp32 (recipes/llm_qlora.yaml)": ("recipes/llm_qlora.yaml",),
          "QLoRA as above + gradient checkpointing (prepare_model_for_kbit_training's default)": (
              "recipes/llm_qlora.yaml", "training.gradient_checkpointing=true")}


def run(recipe: str, overrides: tuple[str, ...], out: Path, steps: int) -> dict:
    command = [sys.executable, "-m", "hf_tune.run", recipe, f"training.output_dir={out}", f"training.max_steps={steps}",
               "training.save_strategy=no", "training.eval_strategy=no", *overrides]
    subprocess.run(command, cwd=ROOT, check=True, capture_output=True, text=True)
    train = json.loads((out / "train_results.json").read_text())
    evaluation = json.loads((out / "eval_results.json").read_text())
    return {"tokens_per_second": train["train_tokens_per_second"], "peak_gb": train["train_peak_memory_gb"],
            "eval_loss": evaluation["eval_loss"], "train_loss": train["train_loss"]}


def weight_bytes(recipe: str) -> float:
    from hf_tune import build_model_and_tokenizer, load_recipe
    from hf_tune.model.quantization import weight_memory

    model, _ = build_model_and_tokenizer(load_recipe(str(ROOT / recipe)))
    return weight_memory(model)["bytes"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()
    results = {name: [] for name in SETUPS}
    with tempfile.TemporaryDirectory(prefix="qlora-bench-") as work:
        for round_ in range(args.repeat):
            for i, (name, (recipe, *overrides)) in enumerate(SETUPS.items()):
                results[name].append(run(recipe, tuple(overrides), Path(work) / f"{round_}-{i}", args.steps))
                print(name, results[name][-1], file=sys.stderr, flush=True)
    weights = {name: weight_bytes(recipe) for name, (recipe, *_) in SETUPS.items()}
    base = results[next(iter(SETUPS))][0]
    print(f"Command: `flock -x /tmp/hf_tune_cpu.lock python benchmarks/qlora_vs_lora.py --steps {args.steps} "
          f"--repeat {args.repeat}`  ")
    print(f"Date: {datetime.date.today()}; machine: {platform.machine()}, no GPU.\n")
    print("| setup | real tok/s | speed vs LoRA | peak RSS GB | base weights MB | train loss | held-out loss |")
    print("|---|---|---|---|---|---|---|")
    for name, runs in results.items():
        speeds = sorted((r["tokens_per_second"] for r in runs), reverse=True)
        median = runs[0] if len(runs) == 1 else sorted(runs, key=lambda r: r["tokens_per_second"])[len(runs) // 2]
        print(f"| {name} | {median['tokens_per_second']:.0f} ({', '.join(f'{s:.0f}' for s in speeds)}) | "
              f"{median['tokens_per_second'] / base['tokens_per_second']:.2f}× | "
              f"{max(r['peak_gb'] for r in runs):.2f} | {weights[name] / 2**20:.0f} | {median['train_loss']:.4f} | "
              f"{median['eval_loss']:.4f} |")


if __name__ == "__main__":
    main()
