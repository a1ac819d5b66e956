"""The Optuna trial loop: ``search(recipe)`` runs (or continues) the study by ask and tell, one trial at a time:
``study.ask`` -> the trial's recipe -> ``build_run`` -> ``Trainer.train`` -> ``study.tell``.

Each trial builds its run (model, optimizer groups, TrainingArguments and schedule) from the recipe with the trial's
values, so any model, LoRA, optim or training key can be searched; the data is read once for every trial. Only the
main process talks to Optuna: under several processes the other ranks train the values it broadcasts and follow its
decisions (another trial or not, and pruning: ``hf_tune.search.pruning``).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import time
from contextlib import nullcontext
from typing import Any

import optuna

from hf_tune.assembly.run_build import build_data, build_run
from hf_tune.model import build_tokenizer
from hf_tune.recipe.checks import search_metrics
from hf_tune.recipe.schema import Recipe, SearchSection
from hf_tune.recipe.search_space import trial_reads_base_data
from hf_tune.runtime.distributed import decided_on_main
from hf_tune.search.backend import StudyPaths, base_recipe, study_paths
from hf_tune.search.cross_validated import search_cross_validated  # it trains folds, not runs
from hf_tune.search.optuna_summary import summarize
from hf_tune.search.pruning import OptunaPruning
from hf_tune.search.resume import heartbeat, resume_orphaned_trials, this_worker
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
from hf_tune.trainer.preemption import Preempted
from hf_tune.training_args import build_training_arguments

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class OptunaSearch:
    """What every trial of one study shares. ``study`` and ``storage`` are the main process's (None elsewhere)."""

    paths: StudyPaths
    spec: SearchSection
    base: Recipe
    data: Any
    rank: int
    world_size: int
    study: Any = None
    storage: Any = None

    def __post_init__(self):
        self.metrics = search_metrics(self.spec)
        self.base_raw = self.base.to_dict()  # what conditions (search.space.KEY.when) read for keys not searched

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def search(recipe: Recipe) -> dict:
    """Run (or continue) the study; write trials.csv, plots, best_recipe.yaml into the study folder. With
    ``search.cv: k`` each trial is the mean over k folds (``hf_tune.search.cross_validated``)."""
    if recipe.search is not None and recipe.search.cv is not None:

        return search_cross_validated(recipe)
    paths = study_paths(recipe)
    base = base_recipe(recipe, paths.folder)
    warn_if_random_search(recipe.search)
    args = build_training_arguments(base)
    data = build_data(base, build_tokenizer(base), args)  # read (sft: tokenized) once, for every trial
    context = OptunaSearch(paths, recipe.search, base, data, rank=args.process_index, world_size=args.world_size)
    if context.is_main:  # only the main process talks to Optuna; the other ranks train the trial it broadcasts
        context.study, context.storage = open_study(recipe.search, paths)
        if context.world_size == 1:  # under several processes a killed trial's ranks cannot be rejoined
            resumed = resume_orphaned_trials(context.study, context.storage, lambda t: paths.trial_folder(t.number),
                                             lambda trial, checkpoint: run_trial(context, trial, checkpoint))
            if resumed:
                logger.info("search: resumed trial(s) %s", resumed)
    run_trials(context)
    if not context.is_main:
        return {}
    return summarize(optuna.load_study(study_name=paths.name, storage=context.storage), recipe, context.metrics,
                     paths)


def run_trials(context: OptunaSearch) -> None:
    """One trial after another while the study has room (search.n_trials, search.timeout, search.terminator): the
    main process decides from the shared storage (trials finished or running anywhere count), every rank follows."""
    terminator = make_terminator(context.spec) if context.is_main else None
    started = time.time()
    while decided_on_main(lambda: study_has_room(context.study, context.spec, started, terminator)):
        trial = ask(context.study) if context.is_main else None
        with heartbeat(context.storage, trial._trial_id) if trial is not None else nullcontext():
            run_trial(context, trial)  # heartbeats, so that no other worker fails it as stale


def run_trial(context: OptunaSearch, trial, resume: str | None = None) -> None:
    """Train one trial on every rank, and on the main process tell Optuna how it ended: COMPLETE with its objective,
    PRUNED, or FAIL with its error. ``resume``: the checkpoint a killed trial trains on from.

    Only the main process holds the Optuna trial: a trial that fails on one rank would leave the others in a
    collective it never joins, so under several processes an error stops the launch (the surplus trial aside, which
    every rank refuses at the same point)."""
    try:
        number, values = decided_on_main(lambda: (trial.number, sample_trial(trial, context.spec.space,
                                                                             context.base_raw)))
        if resume is None and number >= context.spec.n_trials:  # workers that found room at once each started one
            raise SurplusTrial(number, context.spec.n_trials)
        if trial is not None and "worker" not in trial.user_attrs:  # a resumed trial has its new worker already
            trial.set_user_attr("worker", this_worker())
        logger.info("rank %d of %d: trial %s with %s", context.rank, context.world_size, number, values)
        outcome = train_trial(context, trial, number, values, resume)
    except Preempted:  # not a failure: the trial stays RUNNING and a rerun resumes it from the signal's checkpoint
        raise
    except Exception as err:  # a failing trial (OOM, NaN, bad values) keeps its error; the study goes on
        if trial is not None:
            record_failure(context.study, trial, err)
        if context.world_size > 1 and not isinstance(err, SurplusTrial):
            raise
        if not isinstance(err, SurplusTrial):
            logger.warning("search: trial %d failed: %s: %s", trial.number, type(err).__name__, err)
        return
    if trial is None:
        return
    if outcome is None:
        context.study.tell(trial, state=optuna.trial.TrialState.PRUNED)
    else:
        context.study.tell(trial, outcome if len(outcome) > 1 else outcome[0])


def train_trial(context: OptunaSearch, trial, number: int, values: dict[str, Any],
                resume: str | None) -> list[float] | None:
    """Build and train the trial's run in its folder; its objective values, or None when the pruner stopped it."""
    folder = context.paths.trial_folder(number)
    recipe = trial_recipe(dataclasses.replace(context.base, training={**context.base.training,
                                                                      "output_dir": str(folder)}), values)
    pruning = OptunaPruning(trial, context.metrics)
    data = context.data if trial_reads_base_data(recipe, context.base) else None  # None: the trial reads its own
    run = build_run(recipe, data=data, callbacks=[pruning])
    if trial is not None:
        trial.set_user_attr("trainable_params", trainable_params(run.model))
    try:
        run.trainer.train(resume_from_checkpoint=resume)
        if pruning.pruned:
            return None
        results = pruning.results if pruning.results is not None else run.trainer.evaluate()
        return objective_values(context.metrics, results, run.trainer.model)
    finally:
        del run
        gc.collect()
