"""The one writer of a study's folder, for every backend (``optuna_summary.py`` and ``ray_summary.py`` gather what it
writes): ``best_recipe.yaml``, ``trials.csv``, the plots and ``study.json`` (what ``hf-tune compare`` reads back);
and the summary ``hf-tune search`` prints."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any, Callable

import yaml

from hf_tune import run_folder
from hf_tune.catalog.search_backends import SEARCH_BACKENDS
from hf_tune.recipe.schema import Recipe
from hf_tune.redaction import redact_secrets
from hf_tune.search.backend import STUDY_JSON
from hf_tune.search.sampling import trial_recipe

logger = logging.getLogger(__name__)


def write_study_folder(result: dict[str, Any], recipe: Recipe, backend: str, best_values: dict[str, Any], table,
                       plots: dict[str, Callable[[], Any]], note: str = "") -> dict[str, Any]:
    """Write the study folder ``result["study_dir"]``: best_recipe.yaml (the recipe with ``best_values``, the first
    best trial's), trials.csv (``table``, a DataFrame), each plot of ``plots`` (file name: a function drawing it) and
    study.json (the backend, name, metrics and trials); ``result`` gains ``best_recipe`` and ``plots``."""
    study_dir = Path(result["study_dir"])
    result["best_recipe"] = str(write_best_recipe(result, recipe, backend, best_values, note))
    table.to_csv(study_dir / run_folder.TRIALS_CSV, index=False)
    result["plots"] = [path for path in (save_plot(study_dir, name, draw) for name, draw in plots.items()) if path]
    record = {"backend": backend, "study_name": result["study_name"], "metrics": result["metrics"],
              "trials": result["trials"]}
    (study_dir / STUDY_JSON).write_text(json.dumps(record, indent=1, default=str) + "\n")
    return result


def write_best_recipe(result: dict[str, Any], recipe: Recipe, backend: str, best_values: dict[str, Any],
                      note: str = "") -> Path:
    """best_recipe.yaml: the recipe with the best trial's values, training into ``study_dir/best``, no search."""
    study_dir, best = Path(result["study_dir"]), result["best"][0]
    best_recipe = trial_recipe(dataclasses.replace(recipe, training={**recipe.training,
                                                                     "output_dir": str(study_dir / "best")}),
                               best_values)
    path = study_dir / run_folder.BEST_RECIPE
    raw = {k: v for k, v in redact_secrets(best_recipe.to_dict()).items() if k != "search"}
    title = SEARCH_BACKENDS[backend].title
    path.write_text(f"# best trial {best['number']} of study {result['study_name']} ({title}): "
                    f"{dict(zip(result['metrics'], best['values']))}\n" + note + yaml.safe_dump(raw, sort_keys=False))
    return path


def save_plot(study_dir: Path, name: str, draw: Callable[[], Any]) -> str | None:
    """Save what ``draw()`` returns (a figure, axes, or an array of axes) as ``study_dir/name``; None when it cannot
    be drawn (e.g. importances need two finished trials that differ)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.figure import Figure

    try:
        with matplotlib.rc_context():  # Optuna's plots set the ggplot style process-wide: undone on leaving
            drawn = draw()
            figure = drawn if isinstance(drawn, Figure) else drawn.figure if hasattr(drawn, "figure") else \
                drawn.flat[0].figure
            figure.tight_layout()
            figure.savefig(study_dir / name, dpi=100)
            plt.close(figure)
        return str(study_dir / name)
    except Exception as err:  # a plot is a convenience: the study's results are in trials.csv
        logger.warning("search: no %s (%s)", name, err)
        return None


def format_summary(result: dict) -> str:
    lines = [f"study {result['study_name']} in {result['study_dir']}: {len(result['trials'])} trials", "",
             f"{'#':>3} {'state':<9} {', '.join(result['metrics']):<24} params"]
    for t in result["trials"]:
        values = ", ".join(f"{v:.4g}" for v in t["values"]) if t["values"] else "-"
        lines.append(f"{t['number']:>3} {t['state']:<9} {values:<24} {t['params']}"
                     + (f"\n      error: {t['error']}" if t["error"] else ""))
        if t.get("fold_order") is not None:
            ran = ", ".join(f"{k}: {v:.4g}" if isinstance(v, float) else f"{k}: {v}"
                            for k, v in t["fold_values"].items())
            lines.append(f"      folds {len(t['fold_values'])}/{len(t['fold_order'])} {{{ran}}}")
    if result.get("running"):
        lines.append(f"\nno trial has completed yet; running in other workers: {result['running']} (with a journal "
                     "file, possibly left so by a killed worker). The worker that finishes last writes the best "
                     "recipe.")
        return "\n".join(lines)
    if result.get("terminated"):
        lines.append(f"\nthe Terminator ({result['terminated']['by']}) stopped the study after "
                     f"{result['terminated']['after_trials']} trials: more were unlikely to improve on the best")
    for b in result["best"]:
        lines.append(f"\nbest: trial {b['number']} {dict(zip(result['metrics'], b['values']))} {b['params']}")
    if result.get("exploits") is not None:
        lines.append(f"PBT: {len(result['exploits'])} exploit(s), each mutated key per trial and step in "
                     f"{result['study_dir']}/pbt_schedule.csv")
    lines.append(f"best recipe: {result['best_recipe']}  (python -m hf_tune.run {result['best_recipe']})")
    lines += [f"plot: {p}" for p in result["plots"]]
    return "\n".join(lines)
