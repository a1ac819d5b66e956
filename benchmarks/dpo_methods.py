"""DPO, reward model and GRPO on the embedded SmolLM2-135M-Instruct: memory, reward-model accuracy, GRPO rewards.

  python benchmarks/dpo_methods.py memory [--steps 8]   peak RSS and s/step of a LoRA DPO run, one process per setup,
                                                          side by side: hf_tune's default (reference = the adapter
                                                          disabled, log-probabilities precomputed once), the same
                                                          computing the reference every step, and TRL with an
                                                          explicit reference model (a second copy of the model)
  python benchmarks/dpo_methods.py reward                 held-out pair accuracy of recipes/reward_model.yaml before
                                                          and after its training
  python benchmarks/dpo_methods.py grpo [--seeds 0 1 2]   mean reward of recipes/llm_grpo.yaml's first and last
                                                          quarter of steps, per seed

Each setup or seed runs in its own process, one after the other; the figures are printed as a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MEMORY_SETUPS = {
    "hf_tune": "hf_tune default: reference = adapter disabled, log-probabilities precomputed once",
    "no_precompute": "hf_tune, reference forward every step (TRL's default with peft_config)",
    "trl_ref_model": "TRL DPOTrainer with an explicit reference model (a second copy), reference forward every step",
}


def run_child(*args: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "child", *args], cwd=REPO, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def dpo_child(setup: str, steps: int, work: Path) -> dict:
    from hf_tune import load_recipe
    from hf_tune.assembly.run_build import build_run

    overrides = [f"training.max_steps={steps}", f"training.output_dir={work / setup}", "training.save_strategy=no",
                 "training.eval_strategy=no", "training.logging_steps=1", "training.disable_tqdm=true"]
    if setup != "hf_tune":
        overrides.append("training.precompute_ref_log_probs=false")
    recipe = load_recipe(REPO / "recipes" / "llm_dpo.yaml", overrides)
    if setup == "trl_ref_model":  # the same data, tokenizer and arguments, through TRL alone
        import dataclasses

        from peft import LoraConfig
        from trl import DPOTrainer

        from hf_tune.model import build_model, build_tokenizer

        tok, plain = build_tokenizer(recipe), dataclasses.replace(recipe, lora=None)
        trainer = DPOTrainer(model=build_model(plain, tok), ref_model=build_model(plain, tok), args=build_args(recipe),
                             train_dataset=raw_train(recipe), processing_class=tok,
                             peft_config=LoraConfig(task_type="CAUSAL_LM", **recipe.lora))
    else:
        trainer = build_run(recipe).trainer
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    return {"peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "s_per_step": seconds / steps, "first_loss": losses[0], "last_loss": losses[-1]}


def build_args(recipe):
    from hf_tune.training_args import build_training_arguments

    return build_training_arguments(recipe)


def raw_train(recipe):
    from hf_tune.data import data_seed
    from hf_tune.data.preference import load_method_data

    return load_method_data(recipe.data, recipe.method, data_seed(recipe))[0]


def reward_child(work: Path) -> dict:
    from hf_tune import load_recipe
    from hf_tune.assembly.run_build import build_run

    recipe = load_recipe(REPO / "recipes" / "reward_model.yaml", [f"training.output_dir={work / 'reward'}",
                                                                   "training.disable_tqdm=true"])
    trainer = build_run(recipe).trainer
    before = trainer.evaluate()["eval_accuracy"]
    trainer.train()
    after = trainer.evaluate()["eval_accuracy"]
    return {"held_out_pairs": len(trainer.eval_dataset), "accuracy_before": before, "accuracy_after": after}


def grpo_child(seed: int, work: Path) -> dict:
    from hf_tune import load_recipe
    from hf_tune.assembly.run_build import build_run

    recipe = load_recipe(REPO / "recipes" / "llm_grpo.yaml", [f"training.output_dir={work / f'grpo{seed}'}",
                                                               f"training.seed={seed}", "training.logging_steps=1",
                                                               "training.save_strategy=no",
                                                               "training.disable_tqdm=true"])
    trainer = build_run(recipe).trainer
    trainer.train()
    rewards = [e["reward"] for e in trainer.state.log_history if "reward" in e]
    quarter = max(len(rewards) // 4, 1)
    return {"steps": len(rewards), "first_quarter": sum(rewards[:quarter]) / quarter,
            "last_quarter": sum(rewards[-quarter:]) / quarter, "rewards": rewards}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["memory", "reward", "grpo", "child"])
    parser.add_argument("rest", nargs="*")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args()
    os.environ.setdefault("HF_TUNE_CACHE", tempfile.mkdtemp(prefix="hf_tune_bench_cache_"))  # no reuse from earlier
    if args.what == "child":
        kind, *rest = args.rest
        work = Path(tempfile.mkdtemp(prefix="hf_tune_bench_"))
        result = {"dpo": lambda: dpo_child(rest[0], int(rest[1]), work), "reward": lambda: reward_child(work),
                  "grpo": lambda: grpo_child(int(rest[0]), work)}[kind]()
        print(json.dumps(result))
        return
    if args.what == "memory":
        print(f"Command: `python benchmarks/dpo_methods.py memory --steps {args.steps}`\n")
        print("| setup | peak RSS GB | s/step | first loss | last loss |\n|---|---|---|---|---|")
        for setup, label in MEMORY_SETUPS.items():
            r = run_child("dpo", setup, str(args.steps))
            print(f"| {label} | {r['peak_rss_gb']:.2f} | {r['s_per_step']:.2f} | {r['first_loss']:.4f} | "
                  f"{r['last_loss']:.4f} |", flush=True)
    elif args.what == "reward":
        r = run_child("reward")
        print("Command: `python benchmarks/dpo_methods.py reward`\n")
        print(f"| held-out pairs | accuracy untrained | accuracy trained |\n|---|---|---|\n"
              f"| {r['held_out_pairs']} | {r['accuracy_before']:.3f} | {r['accuracy_after']:.3f} |")
    else:
        print(f"Command: `python benchmarks/dpo_methods.py grpo --seeds {' '.join(map(str, args.seeds))}`\n")
        print("| seed | steps | mean reward, first quarter | mean reward, last quarter |\n|---|---|---|---|")
        for seed in args.seeds:
            r = run_child("grpo", str(seed))
            print(f"| {seed} | {r['steps']} | {r['first_quarter']:.3f} | {r['last_quarter']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
