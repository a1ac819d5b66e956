"""A cross-validated study (``search.cv: k``): a trial's value is the mean of its metric over k stratified folds of
data.train, the same seeded folds for every trial (``hf_tune.search.folds.kfold_splits``), each fold trained and
evaluated by ``hf_tune.search.folds.train_fold``.

A trial reports each fold's metric as an intermediate value with step = the fold's id, so Optuna's WilcoxonPruner
pairs it fold by fold with the best trial's same folds, and stops the trial after the fold where the paired test
says it is worse. It trains its folds in an order shuffled per trial (seeded by ``search.seed`` + the trial number),
as Optuna advises for that pruner: with one fixed order the first folds would decide every pruning, and the search
would fit them. Trials run by Optuna's ask and tell, since a trial is k Trainer runs, not the one that
``Trainer.hyperparameter_search`` drives.
"""

from __future__ import annotations

import gc
import logging
import os
import time
import warnings
from pathlib import Path

import numpy as np
import optuna

from hf_tune.errors import HfTuneError
from hf_tune.recipe.checks import search_metrics
from hf_tune.recipe.schema import Recipe, SearchSection
from hf_tune.search.backend import base_recipe, study_paths
from hf_tune.search.folds import Folds, kfold_splits, train_fold
from hf_tune.search.optuna_summary import FOLD_ORDER, FOLD_VALUES, summarize
from hf_tune.search.resume import claimed_orphans, heartbeat, this_worker
from hf_tune.search.sampling import make_terminator, sample_trial, trial_recipe, warn_if_random_search
from hf_tune.search.study import (
    SurplusTrial,
    ask,
    objective_values,
    open_study,
    record_failure,
    study_has_room,
    trainable_params,
)
from hf_tune.trainer.checkpoints import last_complete_checkpoint
from hf_tune.trainer.preemption import Preempted

logger = logging.getLogger(__name__)


def search_cross_validated(recipe: Recipe) -> dict:
    """Run (or continue) the cross-validated study; write trials.csv, plots, best_recipe.yaml into the study folder."""
    spec = recipe.search
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise HfTuneError("search.cv: a cross-validated search trains its folds in one process\n  fix: run it "
                          "without torchrun / accelerate launch, or remove search.cv")
    paths = study_paths(recipe)
    study_dir = paths.folder
    base = base_recipe(recipe, study_dir)
    warn_if_random_search(spec)
    folds = kfold_splits(base, spec.cv, key="search.cv")
    study, storage = open_study(spec, paths)
    metrics = search_metrics(spec)
    base_raw = base.to_dict()  # what conditions (search.space.KEY.when) read for keys not searched
    for frozen in claimed_orphans(study, storage, lambda t: paths.trial_folder(t.number)):  # killed workers
        trial = optuna.trial.Trial(study, frozen._trial_id)
        logger.info("search: trial %d was left running by a worker that is gone; resuming it after its folds %s",
                    trial.number, sorted(int(k) for k in frozen.user_attrs.get(FOLD_VALUES, {})))
        trial.set_user_attr("resumed", True)
        with heartbeat(storage, trial._trial_id):
            run_trial(study, trial, base, base_raw, folds, metrics, paths.trial_folder(trial.number), spec,
                      resumed=frozen)
    with warnings.catch_warnings():  # a killed worker's trial elsewhere fails once its heartbeat is stale
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)
    terminator = make_terminator(spec, cross_validated=True)
    started = time.time()
    while study_has_room(study, spec, started, terminator):
        trial = ask(study)
        with heartbeat(storage, trial._trial_id):  # so that no other worker fails it as stale
            run_trial(study, trial, base, base_raw, folds, metrics, paths.trial_folder(trial.number), spec)
    return summarize(optuna.load_study(study_name=paths.name, storage=storage), recipe, metrics, paths)


def fold_order(spec: SearchSection, number: int) -> list[int]:
    """Trial ``number``'s order of the fold ids: a permutation seeded by search.seed + the trial number."""
    return [int(k) for k in np.random.default_rng(spec.seed + number).permutation(spec.cv)]


def run_trial(study, trial, base: Recipe, base_raw: dict, folds: Folds, metrics: list[str], trial_dir: Path,
              spec: SearchSection, resumed=None) -> None:
    """Train the trial's folds in its order, reporting each; tell Optuna the mean (COMPLETE), PRUNED or FAIL.
    ``resumed``: the trial as a killed worker left it (its parameters and the folds it finished are kept)."""
    try:
        if resumed is None and trial.number >= spec.n_trials:  # workers that found room at once each started one
            raise SurplusTrial(trial.number, spec.n_trials)
        trial.set_user_attr("worker", this_worker())
        current = trial_recipe(base, sample_trial(trial, spec.space, base_raw))  # a resumed trial's: as stored
        logger.info("search: trial %d with %s", trial.number, trial.params)
        done = {int(k): v if isinstance(v, list) else [v]
                for k, v in (resumed.user_attrs.get(FOLD_VALUES, {}) if resumed is not None else {}).items()}
        scores, pruned = train_folds(trial, current, folds, metrics, trial_dir, spec, done)
    except Preempted:  # not a failure: the trial stays RUNNING and a rerun resumes it from the signal's checkpoint
        raise
    except Exception as err:  # a failing trial (OOM, NaN, bad values) keeps its error; the study goes on
        logger.warning("search: trial %d failed: %s: %s", trial.number, type(err).__name__, err)
        record_failure(study, trial, err)
        return
    means = [float(np.mean([values[i] for values in scores.values()])) for i in range(len(metrics))]
    if pruned:
        tell_pruned(study, trial, means[0])
        logger.info("search: trial %d pruned after %d of %d folds", trial.number, len(scores), spec.cv)
        return
    if len(metrics) == 1:  # the noise that the Terminator's CrossValidationErrorEvaluator reads
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # optuna.terminator is marked deprecated
            from optuna.terminator import report_cross_validation_scores

            report_cross_validation_scores(trial, [values[0] for values in scores.values()])
    study.tell(trial, means if len(metrics) > 1 else means[0])


def train_folds(trial, recipe: Recipe, folds: Folds, metrics: list[str], trial_dir: Path, spec: SearchSection,
                done: dict[int, list[float]] | None = None) -> tuple[dict[int, list[float]], bool]:
    """The trial's ``{fold id: metric values}`` in the order trained, and whether the pruner stopped it. Each fold
    trains in ``trial_dir/fold-K``; its values are recorded (user attribute ``fold_values``) as soon as it ends.
    ``done``: folds a killed worker finished (kept, not trained again); a fold it left half-trained goes on from
    its last complete checkpoint."""
    order = fold_order(spec, trial.number)
    trial.set_user_attr(FOLD_ORDER, order)
    scores: dict[int, list[float]] = dict(done or {})
    for k in order:
        if k in scores:
            continue
        checkpoint = last_complete_checkpoint(trial_dir / f"fold-{k}")
        trainer, results = train_fold(recipe, folds, k, trial_dir / f"fold-{k}",
                                      resume=str(checkpoint) if checkpoint else None)
        if not scores:
            trial.set_user_attr("trainable_params", trainable_params(trainer.model))
        scores[k] = objective_values(metrics, results, trainer.model)
        del trainer
        gc.collect()
        trial.set_user_attr(FOLD_VALUES, {str(f): v[0] if len(metrics) == 1 else v for f, v in scores.items()})
        if len(metrics) == 1:  # Optuna's pruners judge single-objective studies (multi-objective: pruner none)
            trial.report(scores[k][0], step=k)
            if len(scores) < len(order) and trial.should_prune():
                return scores, True
    return scores, False


def tell_pruned(study, trial, value: float) -> None:
    """Finish the trial as PRUNED with the mean over the folds it ran as its value. ``study.tell`` would record the
    intermediate value of its highest step, here the highest fold id it ran, which is neither its last nor its mean.
    What tell does otherwise: the sampler's ``after_trial``, then the state and value in the storage."""
    state = optuna.trial.TrialState.PRUNED
    frozen = trial.storage.get_trial(trial._trial_id)
    study.sampler.after_trial(study, frozen, state, [value])
    trial.storage.set_trial_state_values(trial._trial_id, state, [value])
