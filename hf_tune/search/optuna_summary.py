"""An Optuna study's outputs: its trials and best trial(s), written by the one study writer (``summary.py``) with
Optuna's plots; and its trials read back from the study's database (``hf-tune compare``)."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

import optuna

from hf_tune import run_folder
from hf_tune.errors import HfTuneError
from hf_tune.recipe.schema import Recipe
from hf_tune.search.backend import StudyPaths, StudyTrial
from hf_tune.search.sampling import params_to_values
from hf_tune.search.summary import write_study_folder

logger = logging.getLogger(__name__)
FOLD_ORDER, FOLD_VALUES = "fold_order", "fold_values"  # a cv trial's user attributes (search.cross_validated)


def summarize(study, recipe: Recipe, metrics: list[str], paths: StudyPaths) -> dict:
    """The study's trials and best trial(s); writes best_recipe.yaml, trials.csv and the plots into its folder."""
    with warnings.catch_warnings():  # trials of killed workers (no heartbeat for a while) are failed first
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)
    study_dir = paths.folder
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
    return write_study_folder(result, recipe, "optuna", params_to_values(recipe.search.space, best[0].params),
                              study.trials_dataframe(), optuna_plots(study, metrics))


def fold_record(trial) -> dict:
    """A cross-validated trial's folds (search.cv): ``fold_values`` {fold id: metric} in the order it trained them
    (a pruned trial: the folds it ran), and ``fold_order``, the order it planned; nothing for other trials."""
    if FOLD_ORDER not in trial.user_attrs:
        return {}
    return {FOLD_VALUES: {int(k): v for k, v in trial.user_attrs.get(FOLD_VALUES, {}).items()},
            FOLD_ORDER: trial.user_attrs[FOLD_ORDER]}


def optuna_plots(study, metrics: list[str]) -> dict:
    """Optuna's plots of the study (the first metric's history and importances; the Pareto front of several)."""
    import optuna.visualization.matplotlib as ov

    def sized(axes):
        figure = axes.figure if hasattr(axes, "figure") else axes.flat[0].figure
        figure.set_size_inches(8, 5)
        return figure

    multi = len(metrics) > 1
    target = (lambda t: t.values[0]) if multi else None
    plots = {"optimization_history.png": lambda: sized(ov.plot_optimization_history(
        study, target=target, target_name=metrics[0])),
        "param_importances.png": lambda: sized(ov.plot_param_importances(
            study, target=target, target_name=metrics[0]))}
    if multi:
        plots["pareto_front.png"] = lambda: sized(ov.plot_pareto_front(study, target_names=metrics))
    return plots


def read_trials(study_dir: Path) -> list[StudyTrial]:
    """Each finished or pruned trial of every study in the folder's database: its values, and its reported curve."""
    storage = f"sqlite:///{(study_dir / run_folder.STUDY_DB).resolve()}"
    trials = []
    for summary in optuna.get_all_study_summaries(storage):
        study = optuna.load_study(study_name=summary.study_name, storage=storage)
        metrics = study.metric_names or (["value"] if len(study.directions) == 1 else
                                         [f"value_{i}" for i in range(len(study.directions))])
        for trial in study.trials:
            if trial.state not in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED):
                continue
            curve = None
            if trial.intermediate_values:
                steps = sorted(trial.intermediate_values)
                curve = ("eval_loss" if metrics == ["eval_loss"] else metrics[0], steps,
                         [trial.intermediate_values[s] for s in steps])
            trials.append(StudyTrial(summary.study_name, trial.number, trial.state.name.lower(), trial.params,
                                     dict(zip(metrics, trial.values or [])), curve))
    return trials
