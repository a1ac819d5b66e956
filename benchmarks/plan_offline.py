"""``hf-tune plan`` of the 70B QLoRA recipe offline: wall time and peak RSS of the command, then hf_tune's per-rank
model-state memory of Llama-3.1-70B set beside DeepSpeed's estimators and accelerate's ``estimate-memory`` numbers.

    python benchmarks/plan_offline.py

accelerate's command needs the Hub (it looks the model up there first), so its own functions are called on the same
meta-device model: ``calculate_maximum_sizes`` and ``estimate_training_usage``, which is what the command prints.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes/scale/llama-3.1-70b-qlora-8x80gb.yaml"
MODEL = "meta-llama/Llama-3.1-70B-Instruct"
WORLD = 8
GB = 2**30


def timed_plan() -> tuple[float, float]:
    """Seconds and peak RSS (GB) of ``hf-tune plan`` in a fresh process, the Hub off."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    start = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-m", "hf_tune.commands.cli", "plan", str(RECIPE),
                              "--world-size", str(WORLD), "--out", "/tmp/hf_tune_plan_bench"], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(child.pid, 0)
    seconds = time.perf_counter() - start
    if status:
        raise SystemExit(f"hf-tune plan failed (status {status})")
    return seconds, usage.ru_maxrss * 1024 / GB


def full_fine_tune_comparison() -> list[tuple[str, float, float]]:
    """(estimator, per-rank GB under ZeRO-3, per-rank GB without partitioning) for a bf16 full fine-tune."""
    from accelerate.commands.estimate import estimate_training_usage
    from accelerate.utils import calculate_maximum_sizes
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    from hf_tune.model.memory import model_state_memory, model_state_sizes
    from hf_tune.model.meta import build_meta_model
    from hf_tune.recipe import validate_recipe

    recipe = validate_recipe({"model": {"pretrained_model_name_or_path": MODEL},
                              "data": {"train": {"path": str(REPO / "examples/data/chat_demo.jsonl")}}})
    model = build_meta_model(recipe)
    total, trainable, largest = model_state_sizes(model)
    ours = model_state_memory(total, trainable, largest, WORLD, mixed_precision=True, param_bytes=2)
    # unpartitioned, hf-tune init keeps float32 weights under bf16 autocast (16 bytes a parameter)
    replicated = model_state_memory(total, trainable, largest, WORLD, mixed_precision=True, param_bytes=4)
    _, per_gpu, _ = estimate_zero3_model_states_mem_needs(total, largest, WORLD, 1, cpu_offload=False)
    fp32_bytes, _ = calculate_maximum_sizes(model.float())  # accelerate sizes the float32 model
    usage = estimate_training_usage(fp32_bytes, "bfloat16")
    accelerate_peak = usage["model"] + usage["gradients"] + usage["optimizer"]
    return [("hf_tune plan", ours["ZeRO-3"][0] / GB, replicated["no ZeRO (DDP)"][0] / GB),
            ("DeepSpeed estimate_zero3_model_states_mem_needs", per_gpu / GB, float("nan")),
            ("accelerate estimate-memory (bf16 training)", float("nan"), accelerate_peak / GB)]


def main() -> None:
    seconds, rss = timed_plan()
    print(f"hf-tune plan {RECIPE.relative_to(REPO)} --world-size {WORLD} (HF_HUB_OFFLINE=1): "
          f"{seconds:.1f} s, peak RSS {rss:.2f} GB")
    print(f"\n{MODEL}, full fine-tune, bf16 mixed precision, AdamW, {WORLD} ranks: model states per rank (GB)")
    print(f"{'estimator':<52} {'ZeRO-3':>8} {'unpartitioned':>14}")
    for name, zero3, whole in full_fine_tune_comparison():
        print(f"{name:<52} {zero3:>8.1f} {whole:>14.1f}")


if __name__ == "__main__":
    main()
