"""The memory fit, measured: each method's recipe of tests/test_decisions.py (a tiny Llama with SmolLM2's 49k
vocabulary, full fine-tune, examples that fill 1,024 tokens, silent on checkpointing and the micro-batch) trained one
step as written (upstream's 8 examples a micro-batch, a budget it fits) and fitted to a budget below its plan, one
process at a time: the process's peak RSS (Linux's count), the batch and checkpointing each ran, the step time.

    python benchmarks/memory_fit.py [--methods sft dpo grpo]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

BUDGETS = {"sft": 5.0, "dpo": 6.5, "grpo": 5.0}  # GB, as tests/test_decisions.py fits them


def one_run(method: str, model: str, folder: Path, budget: float, batch: int | None) -> dict:
    from test_decisions import fit_recipe

    folder.mkdir(parents=True)
    raw = fit_recipe(method, model, folder, budget)
    if batch is not None:
        raw["training"]["per_device_train_batch_size"] = batch
    (folder / "recipe.yaml").write_text(yaml.safe_dump(raw))
    subprocess.run([sys.executable, "-m", "hf_tune.run", str(folder / "recipe.yaml")], check=True,
                   capture_output=True, cwd=REPO)
    manifest = json.loads((folder / method / "run.json").read_text())
    decided = manifest["decisions"]
    return {"peak_rss_gb": manifest["metrics"]["train_peak_memory_gb"], "budget_gb": decided["memory"]["budget_bytes"]
            / 2**30, "batch": decided["per_device_train_batch_size"],
            "accumulation": decided["gradient_accumulation_steps"], "checkpointing": decided["checkpointing"],
            "step_s": manifest["metrics"]["train_runtime"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", default=list(BUDGETS))
    ns = parser.parse_args()
    from conftest import save_tiny_llama
    from transformers import AutoTokenizer

    from hf_tune.model.embedded import embedded_model_path

    work = Path(tempfile.mkdtemp(prefix="memory_fit_"))
    model = save_tiny_llama(work / "tiny", AutoTokenizer.from_pretrained(embedded_model_path(
        "embedded:SmolLM2-135M-Instruct")))
    print(f"{'method':<6} {'run':<22} {'batch x acc':>11} {'ckpt':>5} {'peak RSS':>9} {'usable budget':>14} "
          f"{'step':>6}")
    for method in ns.methods:
        for name, budget, batch in (("as written (8 a batch)", 50.0, 8), ("fitted", BUDGETS[method], None)):
            row = one_run(method, model, work / f"{method}-{batch}", budget, batch)
            print(f"{method:<6} {name:<22} {row['batch']:>5} x {row['accumulation']:<3} "
                  f"{'on' if row['checkpointing'] else 'off':>5} {row['peak_rss_gb']:>7.2f} GB "
                  f"{row['budget_gb']:>11.2f} GB {row['step_s']:>5.1f}s")


if __name__ == "__main__":
    main()
