"""The experiment project, end to end, in one command (see README.md beside this file):

    python examples/experiment/experiment.py [--out runs/experiment] [--push ORG/NAME]

1. search learning rate x LoRA rank (Optuna, TPE, median pruning), each trial scored on the held-out persona task;
2. train the best configuration with checkpoints, kill it (SIGKILL) after its first checkpoint, and rerun the same
   command, which resumes it;
3. ``hf-tune reproduce`` the finished run: trained again without a kill, the weights must match bit for bit;
4. perplexity, persona score and generation samples before (the evaluation at step 0) and after;
5. memory and scaling: what ``plan`` promised against what the run measured, and the plan on more processes;
6. push the run to a Hub endpoint (``HF_ENDPOINT``, e.g. a local stand-in) when ``--push`` names a repo;
7. ``report.md`` in the output folder, with all of it.

``--set KEY=VALUE`` overrides the recipe (both the search and the best run), ``--trials N`` the study's size: the
test suite runs it small on a tiny model this way.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
RECIPE = HERE / "recipe.yaml"
SCORE = "eval_hf_tune_persona_acc"


def search_step(out: Path, overrides: list[str], trials: int | None) -> dict:
    from hf_tune import load_recipe, search

    extra = [f"training.output_dir={out / 'search'}", *([f"search.n_trials={trials}"] if trials else [])]
    return search(load_recipe(RECIPE, [*overrides, *extra]))


def best_run_recipe(study_dir: Path, out: Path, save_steps: int) -> Path:
    """The study's best recipe, trained with checkpoints and an evaluation at step 0 (the base model's scores)."""
    recipe = yaml.safe_load((study_dir / "best_recipe.yaml").read_text())
    recipe["training"].update(output_dir=str(out / "best"), save_strategy="steps", save_steps=save_steps,
                              eval_on_start=True)
    path = out / "best.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def train_killed_then_resumed(recipe: Path, run_dir: Path, kill_after: int) -> dict:
    """Train the recipe in a process of its own, SIGKILL it once checkpoint-``kill_after`` is complete, then run the
    same command again: hf_tune resumes from the newest complete checkpoint."""
    command = [sys.executable, "-m", "hf_tune.run", str(recipe)]
    marker = run_dir / f"checkpoint-{kill_after}" / "hf_tune_complete.json"
    started = time.time()
    with open(run_dir.parent / "best-first-launch.log", "w") as log:
        first = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        while first.poll() is None and not marker.exists():
            time.sleep(0.05)
        if first.poll() is not None:
            raise RuntimeError(f"the first launch ended (exit {first.returncode}) before checkpoint-{kill_after}; "
                               f"see {log.name}")
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    killed_at = sorted(p.name for p in run_dir.glob("checkpoint-*"))
    with open(run_dir.parent / "best-resumed.log", "w") as log:
        subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, check=True)
    return {"killed_after": f"checkpoint-{kill_after}", "checkpoints_when_killed": killed_at,
            "exit_when_killed": first.returncode, "seconds": round(time.time() - started, 1),
            "resumed_log": str(run_dir.parent / "best-resumed.log")}


def before_after(run_dir: Path) -> dict:
    """Perplexity and persona score at step 0 (the base: LoRA's B starts at zero) and at the end; the samples."""
    history = json.loads((run_dir / "trainer_state.json").read_text())["log_history"]
    evaluations = [row for row in history if "eval_loss" in row]
    first, last = evaluations[0], evaluations[-1]
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines() if line.strip()]
    steps = sorted({row["step"] for row in samples})
    by_step = {step: {row["prompt"]: row["completion"] for row in samples if row["step"] == step} for step in steps}
    return {"steps": (first["step"], last["step"]),
            "perplexity": (math.exp(first["eval_loss"]), math.exp(last["eval_loss"])),
            "score": (first.get(SCORE), last.get(SCORE)),
            "samples": [(prompt, by_step[steps[0]][prompt], by_step[steps[-1]].get(prompt, ""))
                        for prompt in by_step[steps[0]]]}


def memory_and_scaling(recipe: Path, run_dir: Path) -> dict:
    from hf_tune import load_recipe
    from hf_tune.workflows.plan import plan

    metrics = json.loads((run_dir / "run.json").read_text())["metrics"]
    loaded = load_recipe(recipe)
    planned = {world: plan(loaded, world_size=world, out_dir=run_dir.parent / f"plan-{world}")
               for world in (1, 2, 8)}
    return {"planned_peak_gb": planned[1]["peak_per_rank"] / 2**30,
            "measured_peak_gb": metrics.get("train_peak_memory_gb"),
            "tokens_per_second": metrics.get("train_tokens_per_second"),
            "model_states_gb": {world: {setup: values[0] / 2**30 for setup, values in p["memory_per_rank"].items()}
                                for world, p in planned.items()},
            "trainable_params": planned[1]["trainable_params"]}


def reproduce_step(run_dir: Path) -> tuple[str, bool]:
    from hf_tune.workflows.reproduce import reproduce

    second, comparison = reproduce(run_dir)
    return comparison.report(run_dir, second), comparison.reproduced


def push_step(run_dir: Path, repo_id: str, merged: bool) -> str:
    from hf_tune.workflows.hub import push

    return push(run_dir, repo_id, merged=merged)


def write_report(out: Path, study: dict, resume: dict, reproduced: tuple[str, bool], learned: dict,
                 memory: dict, pushed: str | None) -> Path:
    trials = ["| trial | state | learning_rate | lora.r | persona score |", "|---|---|---|---|---|"]
    for trial in study["trials"]:
        params, values = trial["params"], trial["values"] or []
        trials.append(f"| {trial['number']} | {trial['state']} | {params.get('training.learning_rate', 0):.2e} | "
                      f"{params.get('lora.r')} | {values[0] if values else '-'} |")
    best = study["best"][0]
    (ppl_before, ppl_after), (score_before, score_after) = learned["perplexity"], learned["score"]
    samples = ["| prompt | step 0 (base) | after training |", "|---|---|---|"]
    samples += [f"| {prompt} | {before.strip()} | {after.strip()} |".replace("\n", " ")
                for prompt, before, after in learned["samples"]]
    states = ["| setup | " + " | ".join(f"{w} process(es)" for w in memory["model_states_gb"]) + " |",
              "|---|" + "---|" * len(memory["model_states_gb"])]
    for setup in next(iter(memory["model_states_gb"].values())):
        states.append(f"| {setup} | " + " | ".join(f"{by_setup[setup]:.3f} GB" for by_setup in
                                                     memory["model_states_gb"].values()) + " |")
    lines = [
        "# The experiment", "",
        f"## Search ({len(study['trials'])} trials: learning rate x LoRA rank, median pruning)", "", *trials, "",
        f"Best: trial {best['number']}, {best['params']}, persona score {best['values'][0]}. Study folder: "
        f"`{study['study_dir']}` (`trials.csv`, `best_recipe.yaml`, `optimization_history.png`).", "",
        "## The best configuration, killed and resumed", "",
        f"Killed with SIGKILL after {resume['killed_after']} (checkpoints then: "
        f"{', '.join(resume['checkpoints_when_killed'])}); "
        f"the same command run again resumed from it and finished ({resume['seconds']} s for both launches).", "",
        "## Reproduced from its folder (`hf-tune reproduce`): trained again without a kill", "", "```",
        reproduced[0], "```", "",
        "## What it learned (held-out)", "",
        f"| | step {learned['steps'][0]} (base) | step {learned['steps'][1]} |", "|---|---|---|",
        f"| perplexity on the held-out chats | {ppl_before:.2f} | {ppl_after:.2f} |",
        f"| persona score (hf_tune_persona, 32 questions) | {score_before} | {score_after} |", "",
        *samples, "",
        "## Memory and scaling", "",
        f"`plan` promised a peak of {memory['planned_peak_gb']:.2f} GB per rank (a runtime reserve included); the "
        f"run measured {memory['measured_peak_gb']:.2f} GB, at {memory['tokens_per_second']:.0f} tokens/s on this "
        "machine. "
        f"{memory['trainable_params']:,} trainable parameters. Model states per rank as `plan` gives them:", "",
        *states, "",
        "## Pushed", "", f"{pushed}" if pushed else "Not pushed (pass --push ORG/NAME with HF_ENDPOINT and HF_TOKEN).",
        "",
    ]
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/experiment")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a recipe override")
    parser.add_argument("--trials", type=int, default=None, help="the study's n_trials (default: the recipe's)")
    parser.add_argument("--save-steps", type=int, default=4, help="the best run's checkpoint interval")
    parser.add_argument("--push", default=None, metavar="ORG/NAME", help="push the best run to this repo")
    parser.add_argument("--push-merged", action="store_true", help="push the merged model (a local-folder base)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    print("1/6 search", flush=True)
    study = search_step(out, args.set, args.trials)
    print("2/6 the best configuration: trained, killed after its first checkpoint, resumed", flush=True)
    recipe = best_run_recipe(Path(study["study_dir"]), out, args.save_steps)  # the --set overrides are in it
    resume = train_killed_then_resumed(recipe, out / "best", args.save_steps)
    print("3/6 hf-tune reproduce", flush=True)
    reproduced = reproduce_step(out / "best")
    print("4/6 before and after", flush=True)
    learned = before_after(out / "best")
    print("5/6 memory and scaling", flush=True)
    memory = memory_and_scaling(recipe, out / "best")
    print("6/6 push" if args.push else "6/6 report", flush=True)
    pushed = push_step(out / "best", args.push, args.push_merged) if args.push else None
    report = write_report(out, study, resume, reproduced, learned, memory, pushed)
    print(report.read_text())
    return report


if __name__ == "__main__":
    main()
