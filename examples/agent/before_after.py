"""The held-out lockers before the first GRPO step and after the last (``make agent``): mean reward per source and
the share of rollouts that called the tool, read from the run's logged evaluations (TRL's GRPO evaluation of
``data.eval`` with ``eval_on_start``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

SHOWN = {"eval_reward": "mean reward (both sources)",
         "eval_rewards/Lockers/mean": "looked the locker up (environment)",
         "eval_rewards/code_in_answer/mean": "answered with the code",
         "eval_tools/call_frequency": "tool calls per rollout",
         "eval_tools/failure_frequency": "failed tool calls",
         "eval_tools/stream_drift": "rollouts whose tokens drift"}


def evaluations(run_dir: Path) -> list[dict]:
    state = json.loads((run_dir / "trainer_state.json").read_text())
    return [entry for entry in state["log_history"] if "eval_reward" in entry]


if __name__ == "__main__":
    run = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/llm_agent")
    found = evaluations(run)
    if len(found) < 2:
        sys.exit(f"{run}: {len(found)} logged evaluation(s); the recipe scores the held-out prompts at its first and "
                 "last step (eval_on_start, eval_steps = max_steps)")
    before, after = found[0], found[-1]
    print(f"held-out lockers, step {before['step']} -> step {after['step']}:")
    for key, label in SHOWN.items():
        if key in before and key in after:
            print(f"  {label:38s} {before[key]:6.3f} -> {after[key]:6.3f}")
