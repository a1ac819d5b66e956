"""What a Ray Tune study leaves in its folder, in the Optuna backend's shape and by the same writer (``summary.py``):
the trials and the best trial (``format_summary`` prints both), ``trials.csv``, ``best_recipe.yaml``,
``learning_curves.png``; under PBT also ``pbt_schedule.csv`` / ``pbt_schedule.png`` (each mutated key over the steps
of each trial) and the exploits. ``read_trials`` reads a finished study back (``hf-tune compare``)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from hf_tune.errors import HfTuneError
from hf_tune.recipe.schema import Distribution, Recipe
from hf_tune.recipe.search_space import sample_space
from hf_tune.search.backend import STUDY_JSON, StudyPaths, StudyTrial, trial_folder_name
from hf_tune.search.sampling import typed
from hf_tune.search.summary import write_study_folder

logger = logging.getLogger(__name__)
PARAM_PREFIX = "param:"  # reported with each result: the values the trial trains with at that step (PBT schedule)
REPORTS = "reports.jsonl"  # in a trial's folder: every result it reported, in order (exploits included)
PBT_SCHEDULE_CSV, PBT_SCHEDULE_PNG, LEARNING_CURVES_PNG = "pbt_schedule.csv", "pbt_schedule.png", "learning_curves.png"


def trial_values(space: dict[str, Distribution], config: dict[str, Any], raw: dict[str, Any]) -> dict[str, Any]:
    """The trial's recipe values from its Ray config: declared types, and only keys whose condition holds."""
    return sample_space(space, raw, lambda key, dist: typed(dist, config[key]))


def trial_number(trial_id: str) -> int:
    """Ray's trial ids end with the trial's index (``abc12_00003``): the number the table shows."""
    return int(str(trial_id).rsplit("_", 1)[-1])


def summarize_ray(grid, recipe: Recipe, metric: str, mode: str, paths: StudyPaths) -> dict:
    """The study's trials (a trial ASHA stopped is PRUNED) and best trial; the one study writer writes its folder,
    with the learning curves and, under PBT, the exploits and the schedule of each mutated key."""
    spec, study_dir = recipe.search, paths.folder
    raw = {k: v for k, v in recipe.to_dict().items() if k != "search"}
    max_steps = recipe.training.get("max_steps", -1)
    trials, histories = [], {}
    for result in grid:
        number = trial_number(result.metrics.get("trial_id") or Path(result.path).name)
        histories[number] = read_reports(paths.trial_folder(number))
        last = result.metrics.get(metric)
        error = f"{type(result.error).__name__}: {str(result.error)[:500]}" if result.error else None
        finished = max_steps is None or max_steps <= 0 or result.metrics.get("step") == max_steps
        state = "FAIL" if error or last is None else "COMPLETE" if finished else "PRUNED"  # ASHA stopped it
        trials.append({"number": number, "state": state, "values": [last] if last is not None else None,
                       "params": trial_values(spec.space, result.config, raw), "trainable_params": None,
                       "error": error, "steps": result.metrics.get("step")})
    trials.sort(key=lambda t: t["number"])
    out: dict[str, Any] = {"study_name": paths.name, "metrics": [metric], "trials": trials,
                           "study_dir": str(study_dir), "backend": "ray", "scheduler": spec.scheduler or "asha",
                           "terminated": None, "experiment_path": str(grid.experiment_path)}
    complete = [t for t in trials if t["state"] == "COMPLETE"]
    if not complete:
        raise HfTuneError(f"search: none of the {len(trials)} trials completed; see the errors in {study_dir}")
    pick = min if mode == "min" else max
    best = pick(complete, key=lambda t: t["values"][0])
    out["best"] = [{"number": best["number"], "values": best["values"], "params": best["params"]}]
    plots = {LEARNING_CURVES_PNG: lambda: learning_curves(histories, metric)}
    note = ""
    if out["scheduler"] == "pbt":
        out["exploits"] = read_exploits(Path(grid.experiment_path))
        plots[PBT_SCHEDULE_PNG] = lambda: pbt_schedule(histories, list(spec.space), study_dir)
        note = (f"# PBT changed these values during the trial ({PBT_SCHEDULE_CSV}); this recipe trains with its final "
                "values from the start\n")
    return write_study_folder(out, recipe, "ray", best["params"], trials_table(trials), plots, note)


def trials_table(trials: list[dict]):
    """trials.csv's rows: number, state, value, steps, each value (``params_KEY``), error."""
    import pandas as pd

    rows = [{"number": t["number"], "state": t["state"], "value": (t["values"] or [None])[0], "steps": t["steps"],
             **{f"params_{k}": json.dumps(v) if isinstance(v, (list, dict)) else v for k, v in t["params"].items()},
             "error": t["error"]} for t in trials]
    return pd.DataFrame(rows)


def read_trials(study_dir: Path) -> list[StudyTrial]:
    """The finished and stopped trials of the Ray study in the folder (its study.json), each with the curve of its
    metric over the steps it reported (its folder's reports.jsonl; after a PBT exploit, the step's last report)."""
    record = json.loads((study_dir / STUDY_JSON).read_text())
    metric = record["metrics"][0]
    trials = []
    for t in record["trials"]:
        if t["state"] not in ("COMPLETE", "PRUNED"):
            continue
        history = read_reports(study_dir / trial_folder_name(t["number"]))
        curve = None
        if history is not None and metric in history:
            by_step = dict(zip(history["step"].tolist(), history[metric].tolist()))
            curve = ("eval_loss" if metric == "eval_loss" else "value", list(by_step), list(by_step.values()))
        trials.append(StudyTrial(record["study_name"], t["number"], t["state"].lower(), t["params"],
                                 {"value": t["values"][0]}, curve))
    return trials


def read_reports(folder: Path):
    """A trial's reports (``reports.jsonl``) as a table, or None when it reported nothing."""
    import pandas as pd

    path = folder / REPORTS
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    return pd.DataFrame(rows) if rows else None


def read_exploits(experiment: Path) -> list[dict]:
    """PBT's own record (pbt_global.txt): which trial copied which, at which of their results, with which values."""
    path = experiment / "pbt_global.txt"
    if not path.is_file():
        return []
    exploits = []
    for line in path.read_text().splitlines():
        target, donor, target_iter, donor_iter, donor_config, new_config = json.loads(line)
        exploits.append({"trial": int(str(target).split("_")[0]), "donor": int(str(donor).split("_")[0]),
                         "trial_iteration": target_iter, "donor_iteration": donor_iter,
                         "donor_config": donor_config, "new_config": new_config})
    return exploits


def learning_curves(histories: dict, metric: str):
    """The metric each trial reported, over its steps: one line per trial."""
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 5))
    for number, history in sorted(histories.items()):
        if history is not None and metric in history:
            axes.plot(history["step"], history[metric], marker="o", label=f"trial {number}")
    axes.set_xlabel("step")
    axes.set_ylabel(metric)
    axes.legend(fontsize="small")
    return figure


def pbt_schedule(histories: dict, keys: list[str], study_dir: Path):
    """Each mutated key's value at every reported step of every trial: written as pbt_schedule.csv, drawn one plot
    per key."""
    import matplotlib.pyplot as plt
    import pandas as pd

    rows = []
    for number, history in sorted(histories.items()):
        if history is None:
            continue
        for _, row in history.iterrows():  # in the order the trial reported (a step repeats after an exploit)
            rows.append({"trial": number, "step": row["step"],
                         **{k: row.get(f"{PARAM_PREFIX}{k}") for k in keys}})
    table = pd.DataFrame(rows)
    table.to_csv(study_dir / PBT_SCHEDULE_CSV, index=False)
    figure, axes = plt.subplots(len(keys), 1, figsize=(8, 3 * len(keys)), squeeze=False)
    for axis, key in zip(axes[:, 0], keys):
        for number, part in table.groupby("trial"):
            axis.step(part["step"], part[key], where="post", marker="o", label=f"trial {number}")
        axis.set_ylabel(key)
        axis.set_xlabel("step")
    axes[0, 0].legend(fontsize="small")
    return figure
