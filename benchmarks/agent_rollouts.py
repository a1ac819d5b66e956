"""GRPO's multi-turn rollouts on a CPU: transformers' ``generate`` against its continuous batching
(``training.use_transformers_continuous_batching``), side by side on the same prompts.

    PYTHONPATH=examples/agent python benchmarks/agent_rollouts.py [--model runs/llm_agent_sft/merged] [--rounds 2]

Each setting builds the run of ``recipes/llm_agent.yaml`` (the lockers environment, the qwen2_5 template, 8 rollouts:
2 prompts x 4 generations, up to 80 completion tokens and 2 tool rounds) and times TRL's rollout call
(``_generate_and_score_completions``: the first turn, the tool calls, the turns after them, the rewards) on the same
2 training prompts, ``--rounds`` times after one warm-up round, in one process, one setting after the other.
Reported: rollouts/s and generated tokens/s (the tokens the model wrote, tool results excluded), the best round of
each.
"""

from __future__ import annotations

import argparse
import time


def rollouts(model: str, continuous: bool, rounds: int) -> dict:
    import torch

    from hf_tune import load_recipe
    from hf_tune.assembly.run_build import build_run

    overrides = [f"model.pretrained_model_name_or_path={model}", "training.output_dir=/tmp/agent_rollouts_bench",
                 f"training.use_transformers_continuous_batching={str(continuous).lower()}", "training.seed=0"]
    run = build_run(load_recipe("recipes/llm_agent.yaml", overrides))
    trainer = run.trainer
    rows = [run.data.train[i] for i in (0, 1) for _ in range(trainer.num_generations)]
    trainer.model.eval()
    best = None
    for round_ in range(rounds + 1):
        torch.manual_seed(round_)
        start = time.perf_counter()
        with torch.no_grad():
            batch = trainer._generate_and_score_completions(rows)
        seconds = time.perf_counter() - start
        mask = batch["completion_mask"] * batch["tool_mask"] if batch.get("tool_mask") is not None else \
            batch["completion_mask"]
        written = int(mask.sum())
        if round_ and (best is None or seconds < best[0]):
            best = (seconds, written)
    seconds, written = best
    return {"rollouts_per_s": len(rows) / seconds, "tokens_per_s": written / seconds, "seconds": seconds}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="runs/llm_agent_sft/merged")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    results = {name: rollouts(args.model, continuous, args.rounds)
               for name, continuous in (("generate", False), ("continuous batching", True))}
    for name, result in results.items():
        print(f"{name:20s} {result['rollouts_per_s']:.3f} rollouts/s, {result['tokens_per_s']:.1f} tokens/s "
              f"({result['seconds']:.1f} s for 8 rollouts)")
    ratio = results["continuous batching"]["tokens_per_s"] / results["generate"]["tokens_per_s"]
    print(f"continuous batching / generate: {ratio:.2f}x tokens/s")
