"""Optuna vs Ray Tune on the same tiny space and trial budget, in one run: wall time to the same best metric.

    flock -x /tmp/hf_tune_cpu.lock .venv/bin/python benchmarks/search_backends.py

A 2-layer random Llama (the tests' tiny model), LoRA r=4 on q/v, the shipped chat data, 6 steps with an evaluation
every 2; the space is four learning rates, each tried once (grid) by every backend, so every backend must find the
same best trial. Ray's wall time includes starting and stopping its local instance (the command a user runs).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))


def tiny_llama(folder: Path) -> str:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from hf_tune.model.embedded import embedded_model_path

    tokenizer = AutoTokenizer.from_pretrained(embedded_model_path("embedded:SmolLM2-135M-Instruct"))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def main() -> None:
    from conftest import chat_recipe

    from hf_tune import load_recipe, search

    work = Path(tempfile.mkdtemp(prefix="search_backends_"))
    model = tiny_llama(work / "model")
    space = {"training.learning_rate": {"type": "categorical", "choices": [3e-2, 1e-2, 3e-3, 1e-6]}}
    runs = {"optuna (grid, no pruner)": {"backend": "optuna", "sampler": "grid", "pruner": "none"},
            "ray (grid, scheduler none)": {"backend": "ray", "sampler": "grid", "scheduler": "none"},
            "ray (grid, asha)": {"backend": "ray", "sampler": "grid", "scheduler": "asha"}}
    rows = []
    for name, settings in runs.items():
        raw = chat_recipe(model, work / name.split()[0] / str(len(rows)), max_steps=6, per_device_train_batch_size=4,
                          eval_strategy="steps", eval_steps=2, seed=7)
        raw["data"].update(eval_split=0.05, max_length=64)
        raw["lora"] = {"r": 4, "target_modules": ["q_proj", "v_proj"]}
        raw["search"] = {"space": space, "n_trials": 4, **settings}
        started = time.perf_counter()
        result = search(load_recipe(raw))
        wall = time.perf_counter() - started
        best = result["best"][0]
        states = [t["state"] for t in result["trials"]]
        rows.append((name, wall, best["values"][0], best["params"]["training.learning_rate"],
                     f"{states.count('COMPLETE')} complete, {states.count('PRUNED')} stopped early"))
    base = rows[0][1]
    print("| backend | wall time (s) | x Optuna | best eval_loss | best learning_rate | trials |")
    print("|---|---|---|---|---|---|")
    for name, wall, value, lr, states in rows:
        print(f"| {name} | {wall:.1f} | {wall / base:.2f} | {value:.5f} | {lr:g} | {states} |")


if __name__ == "__main__":
    main()
