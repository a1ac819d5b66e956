"""Comparing runs: the recipe keys that differ, final metrics, tokens/s and peak memory as one table
(``compare_runs`` returns a pandas DataFrame), and one PNG with their loss and eval curves overlaid
(``hf-tune compare RUN_DIR... --out compare.png``). A search's study folder stands for its trials, whichever backend
(Optuna, Ray Tune) ran it."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hf_tune import run_folder
from hf_tune.errors import HfTuneError
from hf_tune.records.lineage import flat_lineage
from hf_tune.records.report import series, watched_scores
from hf_tune.records.run_reader import open_run
from hf_tune.search.backend import STUDY_JSON, read_study_trials, study_backend, trial_folder_name

IGNORED_KEYS = ("training.output_dir",)  # differs between any two runs; the row's name says it
THROUGHPUT = {"tokens/s": "train_tokens_per_second", "peak memory (GB)": "train_peak_memory_gb"}
FINAL = ("train_loss", "eval_loss")  # then every other eval_* metric the runs have


@dataclass
class ComparedRun:
    """One row: a run folder, or a trial of a study."""

    name: str
    recipe: dict[str, str]  # flattened
    metrics: dict[str, float]
    curves: dict[str, tuple[list[int], list[float]]] = field(default_factory=dict)  # "loss" / "eval_loss" by step


def compare_runs(paths: list[str | Path]):
    """A DataFrame with one row per run (or study trial): the recipe keys whose values differ between them, their final
    train and eval metrics, tokens/s and peak memory."""
    return comparison_table(collect_runs(paths))


def collect_runs(paths: list[str | Path]) -> list[ComparedRun]:
    runs: list[ComparedRun] = []
    for path in map(Path, paths):
        if (path / run_folder.MANIFEST).is_file() or (path / run_folder.RECIPE).is_file():
            runs.append(_run_folder(path))
        elif study_backend(path) is not None:
            runs.extend(_study_trials(path))
        else:
            raise HfTuneError(f"{path}: neither a run folder (run.json, recipe.yaml) nor a study folder "
                              f"({run_folder.STUDY_DB}, {STUDY_JSON})\n  fix: pass training.output_dir of runs, or a "
                              "search's folder")
    return runs


def _run_folder(path: Path) -> ComparedRun:
    run = open_run(path)
    manifest = run.manifest(required=False)
    recipe = manifest.get("recipe") or run.recipe()
    metrics = dict(manifest.get("metrics") or {})
    for name in run_folder.RESULTS:  # a run still in progress has no final metrics in run.json yet
        if not metrics:
            metrics.update(run.json(name, required=False) or {})
    watched = watched_scores(run)  # hf-tune eval's scores of the newest checkpoint it scored
    metrics.update(max(watched, key=lambda line: line["step"]) if watched else {})
    metrics.pop("step", None)
    curves = {}
    history = run.trainer_state(required=False).get("log_history", [])
    for key in ("loss", "eval_loss"):
        by_step = dict(zip(*series(history, key)))  # the final evaluate() repeats the last step's eval: once
        if by_step:
            curves[key] = (list(by_step), list(by_step.values()))
    return ComparedRun(str(path), flat_lineage({"recipe": recipe}), metrics, curves)


def _study_trials(study_dir: Path) -> list[ComparedRun]:
    """Each finished or pruned trial of the study in the folder, whichever backend ran it (Optuna: every study in its
    database; Ray Tune): its sampled values over the base recipe (``best_recipe.yaml`` without the trial's keys), its
    objective values, its reported curve, and the loss curve of its last checkpoint where it kept one."""
    trials = read_study_trials(study_dir)
    several = len({t.study_name for t in trials}) > 1
    runs = []
    for trial in trials:
        folder = study_dir / trial_folder_name(trial.number)
        values = {**trial.values, "state": trial.state}
        curves = {trial.curve[0]: (trial.curve[1], trial.curve[2])} if trial.curve else {}
        loss = series(open_run(folder).trainer_state(required=False).get("log_history", []), "loss") \
            if folder.is_dir() else ([], [])
        if loss[0]:
            curves["loss"] = loss
        recipe = {k: json.dumps(v) if not isinstance(v, str) else v for k, v in trial.params.items()}
        runs.append(ComparedRun(f"{folder}" + (f" ({trial.study_name})" if several else ""), recipe, values, curves))
    if not runs:
        raise HfTuneError(f"{study_dir}: the study has no finished or pruned trial yet")
    return runs


def differing_keys(runs: list[ComparedRun]) -> list[str]:
    keys = sorted({k for r in runs for k in r.recipe} - set(IGNORED_KEYS))
    return [k for k in keys if len({r.recipe.get(k) for r in runs}) > 1 or len(runs) == 1]


def comparison_table(runs: list[ComparedRun]):
    import pandas as pd

    keys = differing_keys(runs)
    metric_keys = [k for k in FINAL if any(k in r.metrics for r in runs)]
    metric_keys += sorted({k for r in runs for k in r.metrics if (k.startswith("eval_") and k not in FINAL and not
                           k.endswith(("_runtime", "_per_second")) and k != "eval_steps_per_second")
                           or (k.startswith("value") or k == "state")})
    rows = []
    for run in runs:
        row: dict[str, Any] = {k: _value(run.recipe.get(k)) for k in keys}
        row.update({k: run.metrics.get(k) for k in metric_keys})
        row.update({label: run.metrics.get(key) for label, key in THROUGHPUT.items()})
        rows.append(row)
    table = pd.DataFrame(rows, index=pd.Index([r.name for r in runs], name="run"))
    return table.dropna(axis=1, how="all")


def _value(text: str | None) -> Any:
    """A flattened recipe value back as a number where it is one (so the table sorts and formats numbers)."""
    if text is None:
        return None
    try:
        return json.loads(text) if not text.startswith(("[", "{")) else text
    except ValueError:
        return text


def plot_comparison(runs: list[ComparedRun], out: str | Path) -> Path:
    """One PNG: each run's training loss (solid) and eval loss or reported metric (dashed, dots) over steps, one
    colour per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    fig, (train_ax, eval_ax) = plt.subplots(1, 2, figsize=(11, 4.5))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, run in enumerate(runs):
        colour = colours[i % len(colours)]
        for key, (steps, values) in run.curves.items():
            ax = train_ax if key == "loss" else eval_ax
            ax.plot(steps, values, color=colour, linestyle="-" if key == "loss" else "--",
                    marker=None if key == "loss" and len(steps) > 30 else "o", markersize=3, label=run.name)
    for ax, title in ((train_ax, "training loss"), (eval_ax, "eval loss (or the trials' reported metric)")):
        ax.set_xlabel("step")
        ax.set_title(title)
        if ax.lines:
            ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def format_table(table) -> str:
    import pandas as pd

    with pd.option_context("display.max_columns", None, "display.width", 200, "display.float_format", "{:.4g}".format):
        return table.to_string()
