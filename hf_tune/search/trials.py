"""The trial loop: ``search(recipe)`` runs (or continues) the study, one ``Trainer.hyperparameter_search`` call per
trial, with Optuna.

Each trial rebuilds the model (and the optimizer groups) from the recipe with the trial's values, so any model,
LoRA or optim key can be searched, not only ``TrainingArguments``. Only the main process talks to Optuna: under
several processes the other ranks train the values it broadcasts and follow its decisions (another trial or not,
and pruning: ``HfTuneTrainer._report_to_hp_search``).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from pathlib import Path
from typing import Any

import optuna

from hf_tune.build import Run, build_run
from hf_tune.errors import HfTuneError, RecipeError
from hf_tune.model import build_model
from hf_tune.optim.schedule import resolve_schedule
from hf_tune.recipe.checks import search_metrics
from hf_tune.recipe.schema import Recipe, SearchSection
from hf_tune.search.sampling import (directions_for, make_pruner, make_sampler, make_terminator, sample_trial,
                                     trial_recipe, typed, warn_if_random_search)
from hf_tune.search.resume import resume_orphaned_trials, this_worker
from hf_tune.search.storage import make_storage
from hf_tune.search.summary import summarize

logger = logging.getLogger(__name__)


def search(recipe: Recipe) -> dict:
    """Run (or continue) the study; write trials.csv, plots, best_recipe.yaml into the study folder."""
    if recipe.search is None:
        raise RecipeError("search", "the recipe has no search section", fix="add search.space (see the README)")
    spec = recipe.search
    study_dir = Path(spec.output_dir or recipe.training["output_dir"])
    study_name = spec.study_name or (recipe.source.stem if recipe.source else "study")
    base = base_recipe(recipe, study_dir)
    warn_if_random_search(spec)
    hooks = TrialHooks(base, spec)
    trainer = build_run(base, trial_hooks=hooks).trainer  # each trial builds only its model
    record_trial_errors(trainer)
    # only the main process talks to Optuna; the other ranks train the trial it broadcasts
    storage = make_storage(spec, study_dir) if trainer.is_world_process_zero() else None
    if trainer.is_world_process_zero():
        study_dir.mkdir(parents=True, exist_ok=True)
        resume_killed_trials(trainer, hooks, storage, study_name, study_dir)
    run_trials(trainer, hooks, storage, study_name)
    if not trainer.is_world_process_zero():
        return {}
    return summarize(optuna.load_study(study_name=study_name, storage=storage), recipe, hooks.metrics, study_dir)


def trial_folder_name(trial) -> str:
    return f"trial-{trial.number}"


def resume_killed_trials(trainer, hooks: TrialHooks, storage, study_name: str, study_dir: Path) -> None:
    """Trials that a killed worker of this host left RUNNING train on from their last complete checkpoint
    (``search.resume``); under several processes they are left as they are (their ranks cannot be rejoined)."""
    optuna.create_study(study_name=study_name, storage=storage, load_if_exists=True,
                        directions=directions_for(hooks.spec))
    if trainer.args.world_size > 1:
        return
    resumed = resume_orphaned_trials(trainer, hooks, storage, study_name, study_dir, trial_folder_name)
    if resumed:
        logger.info("search: resumed trial(s) %s", resumed)


def base_recipe(recipe: Recipe, study_dir: Path) -> Recipe:
    """The recipe every trial starts from: training into the study folder, searched training keys at their low
    value in the declared type (Trainer casts a trial's values to the base value's type), no search section."""
    training = {**recipe.training, "output_dir": str(study_dir)}
    for key, dist in recipe.search.space.items():
        if key.startswith("training.") and dist.type != "categorical":
            training[key.removeprefix("training.")] = typed(dist, dist.low)
    return dataclasses.replace(recipe, training=training, search=None)


class TrialHooks:
    """The functions Trainer's search calls for each trial: ``model_init`` (Trainer calls it before ``hp_space``, so
    it samples the trial's values itself), ``hp_space`` and ``compute_objective``."""

    def __init__(self, base: Recipe, spec: SearchSection):
        self.base, self.spec = base, spec
        self.base_raw = base.to_dict()  # what conditions (search.space.KEY.when) read for keys not searched
        self.metrics = search_metrics(spec)
        self.run: Run | None = None  # attached by build_run, before the trainer (which calls model_init) exists
        self._trial_recipe: tuple[int | None, Recipe | None] = (None, None)

    def attach(self, run: Run) -> None:
        self.run = run

    @property
    def trainer(self):
        return self.run.trainer

    def sample(self, trial) -> dict[str, Any]:  # Optuna returns the same value when a trial suggests a key again
        return sample_trial(trial, self.spec.space, self.base_raw)

    def trial_recipe(self, trial) -> Recipe:
        """The base recipe with the trial's values, validated once per trial (model_init and hp_space both ask)."""
        if self._trial_recipe[0] != trial.number:
            self._trial_recipe = (trial.number, trial_recipe(self.base, self.sample(trial)))
        return self._trial_recipe[1]

    def model_init(self, trial=None):
        current = self.base
        if trial is not None:
            if trial.number >= self.spec.n_trials:  # every rank holds the number: rank 0's trial, the others' copy
                raise SurplusTrial(trial.number, self.spec.n_trials)
            values = self.sample(trial)
            args = self.run.args
            logger.info("rank %d of %d: trial %s with %s", args.process_index, args.world_size, trial.number,
                        values)
            current = self.trial_recipe(trial)
            self.trainer.optim = current.optim  # the groups of this trial's optimizer
        model = build_model(current, self.run.tokenizer, self.run.data.labels)
        if trial is not None and hasattr(trial, "set_user_attr"):
            trial.set_user_attr("trainable_params", trainable_params(model))
            if "worker" not in trial.user_attrs:  # a resumed trial has its new worker already
                trial.set_user_attr("worker", this_worker())
        return model

    def hp_space(self, trial) -> dict[str, Any]:
        """The trial's TrainingArguments values: its training keys, and the schedule resolved from its optim and
        training keys (Trainer sets only these on its arguments, so a searched optim.min_lr_ratio acts here)."""
        values = self.sample(trial)
        current = self.trial_recipe(trial)
        schedule = resolve_schedule(current.training, current.optim)
        space = {k.removeprefix("training."): v for k, v in values.items() if k.startswith("training.")}
        space.update({key: schedule[key] for key in ("lr_scheduler_type", "lr_scheduler_kwargs") if key in schedule})
        return space

    def compute_objective(self, results: dict[str, float]):
        values = objective_values(self.metrics, results, self.trainer.model)
        return values if len(self.metrics) > 1 else values[0]


def objective_values(metrics: list[str], results: dict[str, float], model) -> list[float]:
    """The value of each search metric: from the evaluation ``results``, or the model's trainable parameters."""
    missing = [m for m in metrics if m != "trainable_params" and m not in results]
    if missing:
        raise HfTuneError(f"search.metric: {missing} not in the evaluation results {sorted(results)}")
    return [float(trainable_params(model)) if m == "trainable_params" else results[m] for m in metrics]


def run_trials(trainer, hooks: TrialHooks, storage, study_name: str) -> None:
    """One ``hyperparameter_search`` call per trial while the study has room (search.n_trials, search.timeout)."""
    spec, metrics, directions = hooks.spec, hooks.metrics, directions_for(hooks.spec)
    multi = len(metrics) > 1
    # Only rank 0 holds the Optuna trial (the others train a copy of its values): a trial that fails on one rank
    # leaves the others in a collective it never joins, so under several processes an error stops the launch.
    distributed = trainer.args.world_size > 1
    pruner = ddp_pruner(spec, trainer.args.world_size)
    terminator = make_terminator(spec) if trainer.is_world_process_zero() else None
    started = time.time()
    while _another_trial(trainer, storage, study_name, directions, spec, started, terminator):
        # After each call upstream asks the study for its best trial, which raises ValueError while no trial has
        # completed (all pruned or failed so far). Trials never leave COMPLETE, so that can happen only if none had
        # completed before the call.
        lookup_may_fail = trainer.is_world_process_zero() and not _has_complete_trial(storage, study_name)
        try:
            trainer.hyperparameter_search(
                hp_space=hooks.hp_space, compute_objective=hooks.compute_objective, n_trials=1,
                direction=directions if multi else directions[0], backend="optuna",
                hp_name=trial_folder_name, study_name=study_name, storage=storage,
                load_if_exists=True, sampler=make_sampler(spec), pruner=pruner,
                catch=(SurplusTrial,) if distributed else (Exception,), gc_after_trial=True,
            )
        except (optuna.TrialPruned, SurplusTrial):  # the other ranks: upstream's loop for them lets these out
            if trainer.is_world_process_zero():
                raise
        except ValueError as err:  # the lookup's, unless the trial raised it (under DDP only: see catch)
            if not lookup_may_fail or raised_by_trial(err):
                raise


def ddp_pruner(spec: SearchSection, world_size: int):
    """The recipe's pruner; under several processes only where every rank can follow rank 0's pruning decision."""
    from transformers import Trainer

    pruner = make_pruner(spec)
    if world_size > 1 and not hasattr(Trainer, "_report_to_hp_search"):
        # HfTuneTrainer overrides that hook so every rank follows rank 0: without it a pruned trial would hang the
        # other ranks
        logger.warning("search: this transformers version reports trials another way, so under %d processes pruning "
                       "is off (search.pruner: %s is ignored)", world_size, spec.pruner)
        return optuna.pruners.NopPruner()
    return pruner


def record_trial_errors(trainer) -> None:
    """Store a failing trial's error in its Optuna trial (user attribute ``error``, listed by the summary).

    Trainer's search hands the trial only to ``trainer.train(trial=...)``, and Optuna takes no attributes on a trial
    once it has failed, so the error is stored on its way out of ``train``, on this trainer alone. The error is also
    marked as the trial's own (``raised_by_trial``)."""
    train = trainer.train

    @functools.wraps(train)
    def train_recording_errors(*args, **kwargs):
        try:
            return train(*args, **kwargs)
        except Exception as err:  # a trial that fails (OOM, NaN, bad values) keeps its error in the study
            trial = kwargs.get("trial")
            if trial is not None and hasattr(trial, "set_user_attr") and not isinstance(err, optuna.TrialPruned):
                trial.set_user_attr("error", f"{type(err).__name__}: {str(err)[:500]}")
            err._hf_tune_trial_error = True
            raise

    trainer.train = train_recording_errors


def raised_by_trial(err: BaseException) -> bool:
    return getattr(err, "_hf_tune_trial_error", False)


class SurplusTrial(HfTuneError):
    """A trial created after the study reached n_trials: workers that checked the count at the same moment each
    started one. It fails at once, before any training, so the study runs n_trials trials and not up to
    n_trials + workers - 1. Every rank raises it at the same point, so it is safe to catch under DDP."""

    def __init__(self, number: int, n_trials: int):
        super().__init__(f"search: trial {number} not run: the study already has search.n_trials={n_trials} trials "
                         "(other workers started theirs at the same moment)")
        self.number, self.n_trials = number, n_trials

    def __reduce__(self):
        return type(self), (self.number, self.n_trials)


def trainable_params(model) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def _has_complete_trial(storage, study_name: str) -> bool:
    study = optuna.load_study(study_name=study_name, storage=storage)
    return bool(study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)))


def study_has_room(study, spec: SearchSection, started: float, terminator=None) -> bool:
    """Another trial may start: fewer than n_trials in the study (run anywhere), the timeout not reached, and the
    Terminator (if any) not stopping it; a stop is recorded in the study (user attribute ``terminated``)."""
    go = len(study.trials) < spec.n_trials and (spec.timeout is None or time.time() - started < spec.timeout)
    if go and terminator is not None and terminator.should_terminate(study):
        go = False
        done = len(study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)))
        logger.info("search: the Terminator (%s) stopped the study after %d completed trials of %d",
                    spec.terminator, done, spec.n_trials)
        study.set_user_attr("terminated", {"by": spec.terminator, "after_trials": len(study.trials)})
    return go


def _another_trial(trainer, storage, study_name: str, directions: list[str], spec: SearchSection,
                   started: float, terminator=None) -> bool:
    """Rank 0 decides from the shared storage (trials finished or running anywhere count); other ranks follow."""
    go = False
    if trainer.is_world_process_zero():
        study = optuna.create_study(study_name=study_name, storage=storage, load_if_exists=True,
                                    directions=directions)
        go = study_has_room(study, spec, started, terminator)
    if trainer.args.world_size > 1:
        import torch.distributed as dist

        decision = [go]
        dist.broadcast_object_list(decision, src=0)
        go = decision[0]
    return go
