"""The cost of downstream evaluation as a share of training time: the demo LoRA run (recipes/llm_lora.yaml) trained
alone, with its lm-eval task scored in-process at each evaluation (recipes/llm_lora_eval.yaml), and alone again with
``hf-tune eval --watch`` scoring its checkpoints beside it. Prints a Markdown table (for benchmarks/RESULTS.md).

    flock -x /tmp/hftune.lock python benchmarks/eval_cost.py --work /tmp/eval_cost
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VENV = Path(sys.executable).parent
# the same 20 steps, evaluation every 10 and checkpoints every 10 in all three; the task settings are the eval recipe's
COMMON = ["training.max_steps=20", "training.eval_steps=10", "training.save_steps=10", "training.save_total_limit=null"]


def train(recipe: str, out: Path, *overrides: str) -> dict:
    """One training process; its train_runtime and log history."""
    subprocess.run([sys.executable, "-m", "hf_tune.run", str(REPO / "recipes" / recipe),
                    f"training.output_dir={out}", *COMMON, *overrides], cwd=REPO, check=True, capture_output=True)
    results = json.loads((out / "train_results.json").read_text())
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    return {"train_runtime": results["train_runtime"], "history": history}


def in_process(out: Path) -> dict:
    run = train("llm_lora_eval.yaml", out)
    scored = [e for e in run["history"] if "eval_downstream_runtime" in e]
    run["scoring"] = sum(e["eval_downstream_runtime"] for e in scored)
    run["scores"] = [(e["step"], e["eval_hf_tune_arithmetic_acc"]) for e in scored]
    return run


def watched(out: Path, limit: int) -> dict:
    """Training with ``hf-tune eval --watch`` started beside it; the watcher's lag after training ends."""
    watcher = subprocess.Popen([str(VENV / "hf-tune"), "eval", str(out), "--watch", "--tasks", "hf_tune_arithmetic",
                                "--limit", str(limit), "--batch-size", "8", "--interval", "2", "--device", "cpu"],
                               cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    run = train("llm_lora.yaml", out)
    trained = time.time()
    _, err = watcher.communicate()
    if watcher.returncode:
        raise SystemExit(err[-3000:])
    run["lag"] = time.time() - trained
    lines = [json.loads(line) for line in (out / "eval_scores.jsonl").read_text().splitlines()]
    run["scoring"] = sum(line["seconds"] for line in lines)
    run["scores"] = [(line["step"], line["scores"]["eval_hf_tune_arithmetic_acc"]) for line in lines]
    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, default=Path("/tmp/eval_cost"))
    p.add_argument("--limit", type=int, default=20, help="examples of hf_tune_arithmetic (the eval recipe's)")
    args = p.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    stamp = str(time.time_ns())
    base = train("llm_lora.yaml", args.work / f"base-{stamp}")
    inline = in_process(args.work / f"inline-{stamp}")
    beside = watched(args.work / f"watched-{stamp}", args.limit)
    t0 = base["train_runtime"]
    print("| setup | train_runtime s | vs. training alone | scoring s (share of training alone) | scores (step: acc) "
          "| wait after training s |")
    print("|---|---|---|---|---|---|")
    print(f"| training alone (llm_lora.yaml) | {t0:.1f} | 1.00x | - | - | - |")
    for name, run, lag in (("in-process (llm_lora_eval.yaml)", inline, 0.0),
                           ("watched (hf-tune eval --watch beside it)", beside, beside.get("lag", 0.0))):
        scores = ", ".join(f"{s}: {v:.2f}" for s, v in run["scores"])
        print(f"| {name} | {run['train_runtime']:.1f} | {run['train_runtime'] / t0:.2f}x | {run['scoring']:.1f} "
              f"({run['scoring'] / t0:.0%}) | {scores} | {lag:.1f} |")


if __name__ == "__main__":
    main()
