"""Optuna vs Ray Tune on the same tiny space and trial budget, in one run: wall time to the same best metric.

    flock -x /tmp/hf_tune_cpu.lock .venv/bin/python benchmarks/search_backends.py
    flock -x /tmp/hf_tune_cpu.lock .venv/bin/python benchmarks/search_backends.py cv   # Wilcoxon vs no pruner
    flock -x /tmp/hf_tune_cpu.lock .venv/bin/python benchmarks/search_backends.py pbt-memory

``pbt-memory``: the shipped PBT search (recipes/llm_lora_search.yaml, backend ray, scheduler pbt, n_trials 4) run
twice, once with Ray's actors reused across trials (what hf_tune did before: ``TuneConfig`` patched here to
``reuse_actors=True``) and once as shipped (a fresh actor per trial): the peak RSS of any Ray process, sampled every
2 s, and the wall time.

``cv``: a cross-validated search (search.cv: 5, then 10) of a tiny random BERT classifier on 160 rows of the shipped
topics data, six learning rates each tried once (grid, same seed, so the same trial order), with pruner none and with
the Wilcoxon pruner: folds trained and wall time to the same best trial.

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
    from conftest import save_tiny_llama
    from transformers import AutoTokenizer

    from hf_tune.model.embedded import embedded_model_path

    return save_tiny_llama(folder, AutoTokenizer.from_pretrained(embedded_model_path("embedded:SmolLM2-135M-Instruct")))


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


def tiny_bert(folder: Path) -> str:
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    from hf_tune.model.embedded import embedded_model_path

    tokenizer = AutoTokenizer.from_pretrained(embedded_model_path("embedded:all-MiniLM-L6-v2"))
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=2, max_position_embeddings=64, num_labels=4)
    BertForSequenceClassification(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def wilcoxon_vs_none(rows_used: int = 160, n_trials: int = 6) -> None:
    """The same cross-validated grid with pruner none and wilcoxon (Optuna's p_threshold 0.1, and 0.2), 5 and 10
    folds. A paired test over n folds reaches p = 2^-n at best, so p_threshold 0.1 prunes after 4 folds at the
    earliest, 0.2 after 3."""
    from hf_tune import load_recipe, search

    work = Path(tempfile.mkdtemp(prefix="search_cv_"))
    model = tiny_bert(work / "model")
    train = work / "topics.jsonl"
    train.write_text("\n".join((REPO / "examples/data/topics_train.jsonl").read_text().splitlines()[:rows_used]) + "\n")
    space = {"training.learning_rate": {"type": "categorical", "choices": [1e-2, 3e-3, 1e-3, 3e-4, 1e-4, 1e-9]}}
    runs = [(5, "none", {"pruner": "none"}), (5, "wilcoxon (p_threshold 0.1)", {"pruner": "wilcoxon"}),
            (5, "wilcoxon (p_threshold 0.2)", {"pruner": "wilcoxon", "pruner_kwargs": {"p_threshold": 0.2}}),
            (10, "none", {"pruner": "none"}), (10, "wilcoxon (p_threshold 0.1)", {"pruner": "wilcoxon"})]
    rows = []
    for i, (folds, name, settings) in enumerate(runs):
        raw = {"model": {"pretrained_model_name_or_path": model, "task": "sequence_classification"},
               "data": {"format": "classification", "train": {"path": str(train)}, "max_length": 32},
               "training": {"output_dir": str(work / f"study-{i}"), "max_steps": 20, "per_device_train_batch_size": 16,
                            "learning_rate": 1e-2, "report_to": "none", "save_strategy": "no", "disable_tqdm": True,
                            "seed": 0},
               "search": {"space": space, "n_trials": n_trials, "sampler": "grid", "cv": folds, **settings}}
        started = time.perf_counter()
        result = search(load_recipe(raw))
        wall = time.perf_counter() - started
        trained = sum(len(t["fold_values"]) for t in result["trials"])
        order = [t["params"]["training.learning_rate"] for t in result["trials"]]
        pruned = [t for t in result["trials"] if t["state"] == "PRUNED"]
        rows.append((folds, name, trained, wall, result["best"][0], pruned, order))
    print(f"trial order (grid, seed 42): {', '.join(f'{lr:g}' for lr in rows[0][6])}")
    print("| cv | pruner | folds trained | wall time (s) | best eval_loss | best learning_rate "
          "| pruned trials (folds run) |")
    print("|---|---|---|---|---|---|---|")
    for folds, name, trained, wall, best, pruned, _ in rows:
        stopped = ", ".join(f"lr {t['params']['training.learning_rate']:g} ({len(t['fold_values'])})"
                            for t in pruned) or "-"
        print(f"| {folds} | {name} | {trained} of {n_trials * folds} | {wall:.1f} | {best['values'][0]:.4f} "
              f"| {best['params']['training.learning_rate']:g} | {stopped} |")


def pbt_run(reuse: bool, out: str) -> None:
    """One PBT search of the shipped recipe (in its own process: ``pbt_memory`` samples its Ray processes)."""
    import dataclasses

    from ray import tune

    from hf_tune import load_recipe, search

    if reuse:  # the earlier behaviour: Ray's actors reused across trials
        original = tune.TuneConfig

        def reusing(*args, **kwargs):
            return dataclasses.replace(original(*args, **kwargs), reuse_actors=True)

        tune.TuneConfig = reusing
    overrides = ["search.backend=ray", "search.scheduler=pbt", "search.n_trials=4", f"training.output_dir={out}"]
    search(load_recipe(REPO / "recipes" / "llm_lora_search.yaml", overrides))


def pbt_memory() -> None:
    import subprocess

    import psutil

    print("| Ray actors | peak RSS of a Ray process (GB) | wall time (s) |\n|---|---|---|")
    for reuse in (True, False):
        out = tempfile.mkdtemp(prefix="hf_tune_pbt_")
        start, peak = time.perf_counter(), 0
        proc = subprocess.Popen([sys.executable, __file__, "pbt-run", str(int(reuse)), out], cwd=REPO,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        while proc.poll() is None:
            for p in psutil.process_iter(["cmdline", "memory_info"]):
                if p.info["cmdline"] and p.info["cmdline"][0].startswith("ray::") and p.info["memory_info"]:
                    peak = max(peak, p.info["memory_info"].rss)
            time.sleep(2)
        assert proc.returncode == 0, f"the search failed (reuse={reuse})"
        print(f"| {'reused across trials' if reuse else 'one per trial (shipped)'} | {peak / 1e9:.2f} "
              f"| {time.perf_counter() - start:.0f} |")


if __name__ == "__main__":
    if sys.argv[1:2] == ["pbt-run"]:
        pbt_run(sys.argv[2] == "1", sys.argv[3])
    elif sys.argv[1:] == ["pbt-memory"]:
        pbt_memory()
    else:
        wilcoxon_vs_none() if sys.argv[1:] == ["cv"] else main()
