"""Pruning an Optuna trial from inside its training run, as a ``TrainerCallback``: each evaluation's objective is
reported to the trial, and where the pruner says so the run stops at that evaluation, on every rank."""

from __future__ import annotations

from transformers import TrainerCallback

from hf_tune.runtime.distributed import decided_on_main
from hf_tune.search.study import objective_values


class OptunaPruning(TrainerCallback):
    """Reports each evaluation's objective to the trial (``trial.report`` at the global step) and stops training where
    ``trial.should_prune()`` says so. Only the main process holds the Optuna trial (``trial`` is None on the other
    ranks): it reports and asks, and every rank follows its answer (``decided_on_main``), so a pruned trial stops on
    all of them at the same evaluation; a rank that trained on alone would wait in a collective forever.

    Multi-objective studies are not pruned (Optuna's pruners judge one value). ``results`` keeps the last
    evaluation's metrics during training: the trial's objective, as for a trial Optuna runs itself."""

    def __init__(self, trial, metrics: list[str]):
        self.trial, self.metrics = trial, metrics
        self.results: dict[str, float] | None = None
        self.pruned = False
        self.training = False

    def on_train_begin(self, args, state, control, **kwargs):
        self.training = True

    def on_train_end(self, args, state, control, **kwargs):
        self.training = False

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        if not self.training:  # an evaluation after training: not a step of the trial
            return control
        self.results = dict(metrics or {})
        if len(self.metrics) > 1:
            return control
        model, step = kwargs.get("model"), state.global_step

        def report_and_ask() -> bool:
            self.trial.report(objective_values(self.metrics, self.results, model)[0], step)
            return self.trial.should_prune()

        if decided_on_main(report_and_ask):
            self.pruned = True
            control.should_training_stop = True
            control.should_save = False  # a pruned trial leaves no checkpoint of the step that condemned it
        return control
