"""What a Ray Tune study leaves in its folder, in the Optuna backend's shape (one product): the trials and the best
trial (``format_summary`` prints both), ``trials.csv``, ``best_recipe.yaml``, ``learning_curves.png``; under PBT also
``pbt_schedule.csv`` / ``pbt_schedule.png`` (each mutated key over the steps of each trial) and the exploits."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import yaml

from hf_tune import run_folder
from hf_tune.errors import HfTuneError
from hf_tune.recipe.schema import Distribution, Recipe
from hf_tune.recipe.search_space import sample_space
from hf_tune.redaction import redact_secrets
from hf_tune.search.sampling import trial_recipe, typed

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


def summarize_ray(grid, recipe: Recipe, metric: str, mode: str, study_dir: Path, study_name: str) -> dict:
    spec = recipe.search
    raw = {k: v for k, v in recipe.to_dict().items() if k != "search"}
    max_steps = recipe.training.get("max_steps", -1)
    trials, histories = [], {}
    for result in grid:
        number = trial_number(result.metrics.get("trial_id") or Path(result.path).name)
        histories[number] = read_reports(study_dir / f"trial-{number}")
        last = result.metrics.get(metric)
        error = f"{type(result.error).__name__}: {str(result.error)[:500]}" if result.error else None
        finished = max_steps is None or max_steps <= 0 or result.metrics.get("step") == max_steps
        state = "FAIL" if error or last is None else "COMPLETE" if finished else "PRUNED"  # ASHA stopped it
        trials.append({"number": number, "state": state, "values": [last] if last is not None else None,
                       "params": trial_values(spec.space, result.config, raw), "trainable_params": None,
                       "error": error, "steps": result.metrics.get("step")})
    trials.sort(key=lambda t: t["number"])
    out: dict[str, Any] = {"study_name": study_name, "metrics": [metric], "trials": trials,
                           "study_dir": str(study_dir), "backend": "ray", "scheduler": spec.scheduler or "asha",
                           "terminated": None, "experiment_path": str(grid.experiment_path)}
    complete = [t for t in trials if t["state"] == "COMPLETE"]
    if not complete:
        raise HfTuneError(f"search: none of the {len(trials)} trials completed; see the errors in {study_dir}")
    pick = min if mode == "min" else max
    best = pick(complete, key=lambda t: t["values"][0])
    out["best"] = [{"number": best["number"], "values": best["values"], "params": best["params"]}]
    out["best_recipe"] = str(write_best_recipe(recipe, best, metric, study_dir, study_name,
                                               pbt=out["scheduler"] == "pbt"))
    write_trials_csv(trials, study_dir)
    out["plots"] = [write_learning_curves(histories, metric, study_dir)]
    if out["scheduler"] == "pbt":
        out["exploits"] = read_exploits(Path(grid.experiment_path))
        out["plots"].append(write_pbt_schedule(histories, list(spec.space), study_dir))
    return out


def write_best_recipe(recipe: Recipe, best: dict, metric: str, study_dir: Path, study_name: str,
                      pbt: bool) -> Path:
    best_recipe = trial_recipe(dataclasses.replace(recipe, training={**recipe.training,
                                                                     "output_dir": str(study_dir / "best")}),
                               best["params"])
    note = (f"# PBT changed these values during the trial ({PBT_SCHEDULE_CSV}); this recipe trains with its final "
            "values from the start\n") if pbt else ""
    path = study_dir / run_folder.BEST_RECIPE
    raw = {k: v for k, v in redact_secrets(best_recipe.to_dict()).items() if k != "search"}
    path.write_text(f"# best trial {best['number']} of study {study_name} (Ray Tune): {{'{metric}': "
                    f"{best['values'][0]}}}\n" + note + yaml.safe_dump(raw, sort_keys=False))
    return path


def write_trials_csv(trials: list[dict], study_dir: Path) -> None:
    import pandas as pd

    rows = [{"number": t["number"], "state": t["state"], "value": (t["values"] or [None])[0], "steps": t["steps"],
             **{f"params_{k}": json.dumps(v) if isinstance(v, (list, dict)) else v for k, v in t["params"].items()},
             "error": t["error"]} for t in trials]
    pd.DataFrame(rows).to_csv(study_dir / run_folder.TRIALS_CSV, index=False)


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


def _plot(study_dir: Path, name: str, draw) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure = draw(plt)
    figure.tight_layout()
    figure.savefig(study_dir / name, dpi=100)
    plt.close(figure)
    return str(study_dir / name)


def write_learning_curves(histories: dict, metric: str, study_dir: Path) -> str:
    def draw(plt):
        figure, axes = plt.subplots(figsize=(8, 5))
        for number, history in sorted(histories.items()):
            if history is not None and metric in history:
                axes.plot(history["step"], history[metric], marker="o", label=f"trial {number}")
        axes.set_xlabel("step")
        axes.set_ylabel(metric)
        axes.legend(fontsize="small")
        return figure

    return _plot(study_dir, LEARNING_CURVES_PNG, draw)


def write_pbt_schedule(histories: dict, keys: list[str], study_dir: Path) -> str:
    """Each mutated key's value at every reported step of every trial (csv and one plot per key)."""
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

    def draw(plt):
        figure, axes = plt.subplots(len(keys), 1, figsize=(8, 3 * len(keys)), squeeze=False)
        for axis, key in zip(axes[:, 0], keys):
            for number, part in table.groupby("trial"):
                axis.step(part["step"], part[key], where="post", marker="o", label=f"trial {number}")
            axis.set_ylabel(key)
            axis.set_xlabel("step")
        axes[0, 0].legend(fontsize="small")
        return figure

    return _plot(study_dir, PBT_SCHEDULE_PNG, draw)
