"""What a study leaves in its folder and prints: the trials, the best trial(s), best_recipe.yaml, trials.csv and
plots."""

from __future__ import annotations

import dataclasses
import logging
import warnings
from pathlib import Path
from typing import Any

import optuna
import yaml

from hf_tune import run_folder
from hf_tune.errors import HfTuneError
from hf_tune.recipe.schema import Recipe
from hf_tune.redaction import redact_secrets
from hf_tune.search.sampling import params_to_values, trial_recipe

logger = logging.getLogger(__name__)
FOLD_ORDER, FOLD_VALUES = "fold_order", "fold_values"  # a cv trial's user attributes (search.cross_validated)


def summarize(study, recipe: Recipe, metrics: list[str], study_dir: Path) -> dict:
    """The study's trials and best trial(s); writes best_recipe.yaml, trials.csv and the plots into ``study_dir``."""
    with warnings.catch_warnings():  # trials of killed workers (no heartbeat for a while) are failed first
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)
    trials = [{"number": t.number, "state": t.state.name, "values": t.values, "params": t.params,
               "trainable_params": t.user_attrs.get("trainable_params"),
               "error": t.user_attrs.get("error"), **fold_record(t)} for t in study.trials]
    complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    result: dict[str, Any] = {"study_name": study.study_name, "metrics": metrics, "trials": trials,
                              "study_dir": str(study_dir), "terminated": study.user_attrs.get("terminated")}
    running = [t.number for t in study.trials if t.state == optuna.trial.TrialState.RUNNING]
    if not complete and running:  # other workers are still training: the last one to finish writes the summary
        logger.info("search: no trial has completed yet; trial(s) %s still run in other workers (or, with a journal "
                    "file, which has no heartbeat, were left running by a killed one)", running)
        return {**result, "best": [], "running": running}
    if not complete:
        raise HfTuneError(f"search: none of the {len(trials)} trials completed; see the errors in {study_dir}")
    best = study.best_trials if len(metrics) > 1 else [study.best_trial]
    result["best"] = [{"number": t.number, "values": t.values, "params": t.params} for t in best]
    result["best_recipe"] = str(write_best_recipe(study, recipe, metrics, best[0], study_dir))
    study.trials_dataframe().to_csv(study_dir / run_folder.TRIALS_CSV, index=False)
    result["plots"] = write_plots(study, metrics, study_dir)
    return result


def fold_record(trial) -> dict:
    """A cross-validated trial's folds (search.cv): ``fold_values`` {fold id: metric} in the order it trained them
    (a pruned trial: the folds it ran), and ``fold_order``, the order it planned; nothing for other trials."""
    if FOLD_ORDER not in trial.user_attrs:
        return {}
    return {FOLD_VALUES: {int(k): v for k, v in trial.user_attrs.get(FOLD_VALUES, {}).items()},
            FOLD_ORDER: trial.user_attrs[FOLD_ORDER]}


def write_best_recipe(study, recipe: Recipe, metrics: list[str], best, study_dir: Path) -> Path:
    """best_recipe.yaml: the recipe with the best trial's values, training into ``study_dir/best``, no search."""
    spec = recipe.search
    best_values = params_to_values(spec.space, best.params)
    best_recipe = trial_recipe(dataclasses.replace(recipe, training={**recipe.training,
                                                                     "output_dir": str(study_dir / "best")}),
                               best_values)
    path = study_dir / run_folder.BEST_RECIPE
    raw = {k: v for k, v in redact_secrets(best_recipe.to_dict()).items() if k != "search"}
    path.write_text(f"# best trial {best.number} of study {study.study_name}: {dict(zip(metrics, best.values))}\n"
                    + yaml.safe_dump(raw, sort_keys=False))
    return path


def write_plots(study, metrics: list[str], study_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import optuna.visualization.matplotlib as ov

    multi = len(metrics) > 1
    plots = {"optimization_history.png": lambda: ov.plot_optimization_history(
        study, target=(lambda t: t.values[0]) if multi else None, target_name=metrics[0]),
        "param_importances.png": lambda: ov.plot_param_importances(
            study, target=(lambda t: t.values[0]) if multi else None, target_name=metrics[0])}
    if multi:
        plots["pareto_front.png"] = lambda: ov.plot_pareto_front(study, target_names=metrics)
    written = []
    for name, draw in plots.items():
        try:
            axes = draw()
            figure = axes.figure if hasattr(axes, "figure") else axes.flat[0].figure
            figure.set_size_inches(8, 5)
            figure.tight_layout()
            figure.savefig(study_dir / name, dpi=100)
            plt.close(figure)
            written.append(str(study_dir / name))
        except Exception as err:  # e.g. importances need two finished trials that differ
            logger.warning("search: no %s (%s)", name, err)
    return written


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
