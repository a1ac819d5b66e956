"""What the Optuna trial loops share (``trials.py`` and ``cross_validated.py``): opening the study, whether it has
room for another trial, a trial's objective values, and the trial created past search.n_trials."""

from __future__ import annotations

import logging
import time
import warnings

import optuna

from hf_tune.errors import HfTuneError
from hf_tune.recipe.schema import SearchSection
from hf_tune.search.backend import StudyPaths
from hf_tune.search.sampling import directions_for, make_pruner, make_sampler
from hf_tune.search.storage import make_storage

logger = logging.getLogger(__name__)


def open_study(spec: SearchSection, paths: StudyPaths):
    """The study (created, or loaded to continue it) and its storage, with the recipe's sampler and pruner, for
    trials run by ask and tell."""
    paths.folder.mkdir(parents=True, exist_ok=True)
    storage = make_storage(spec, paths.folder)
    study = optuna.create_study(study_name=paths.name, storage=storage, load_if_exists=True,
                                directions=directions_for(spec), sampler=make_sampler(spec, ask_and_tell=True),
                                pruner=make_pruner(spec))
    return study, storage


def ask(study):
    """A new trial. Optuna warns that heartbeats are ``Study.optimize``'s: the loops record them (``heartbeat``)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return study.ask()


def record_failure(study, trial, err: BaseException) -> None:
    """Finish a trial that raised as FAIL, its error kept in the study (user attribute ``error``)."""
    trial.set_user_attr("error", f"{type(err).__name__}: {str(err)[:500]}")
    study.tell(trial, state=optuna.trial.TrialState.FAIL)


def objective_values(metrics: list[str], results: dict[str, float], model) -> list[float]:
    """The value of each search metric: from the evaluation ``results``, or the model's trainable parameters."""
    missing = [m for m in metrics if m != "trainable_params" and m not in results]
    if missing:
        raise HfTuneError(f"search.metric: {missing} not in the evaluation results {sorted(results)}")
    return [float(trainable_params(model)) if m == "trainable_params" else results[m] for m in metrics]


def trainable_params(model) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


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
