"""A Ray Tune trial, in its Ray worker: build the trial's recipe, resume from the checkpoint Ray hands it (under PBT
a donor's, adopted into the trial's folder), train with hf_tune's own Trainer and report every evaluation to Ray."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from hf_tune.recipe.schema import Recipe, SearchSection
from hf_tune.recipe.search_space import trial_reads_base_data
from hf_tune.search.backend import trial_folder_name
from hf_tune.search.ray_summary import PARAM_PREFIX, REPORTS, trial_values
from hf_tune.search.sampling import trial_recipe
from hf_tune.trainer.checkpoints import checkpoints
from hf_tune.training_args import build_training_arguments


def run_trial(config: dict[str, Any], base: Recipe, spec: SearchSection, data, study_dir: str) -> None:
    """One trial (a Ray Tune function trainable): build its recipe, resume from the checkpoint Ray hands it (its
    own, or under PBT a donor's), train, report every evaluation."""
    from ray import tune

    from hf_tune.assembly.run_build import build_run

    number = int(tune.get_context().get_trial_id().rsplit("_", 1)[-1])
    folder = Path(study_dir) / trial_folder_name(number)
    values = trial_values(spec.space, config, base.to_dict())
    recipe = trial_recipe(dataclasses.replace(base, training={**base.training, "output_dir": str(folder)}), values)
    resume = adopt_checkpoint(tune.get_checkpoint(), folder)
    if resume is None:  # a fresh trial: no report of an earlier study in this folder
        (folder / REPORTS).unlink(missing_ok=True)
    report = RayReport(spec.scheduler == "pbt", values)
    data = data if trial_reads_base_data(recipe, base) else None  # None: the trial reads its own
    trainer = build_run(recipe, build_training_arguments(recipe), data=data, callbacks=[report]).trainer
    trainer.train(resume_from_checkpoint=resume)
    if report.last_step != trainer.state.global_step:  # no evaluation at the last step
        trainer.evaluate()


ADOPTED = "adopted_checkpoints.jsonl"  # in a trial's folder: each checkpoint Ray handed it (PBT: a donor's)


def adopt_checkpoint(checkpoint, folder: Path) -> str | None:
    """Copy the checkpoint Ray hands the trial into its folder as ``checkpoint-N`` (dropping any later one of the
    trial's own history), record where it came from, and return its path to resume from; None for a fresh
    trial."""
    if checkpoint is None:
        return None

    with checkpoint.as_directory() as source:
        step = json.loads((Path(source) / "trainer_state.json").read_text())["global_step"]
        target = folder / f"checkpoint-{step}"
        for existing in checkpoints(folder):
            if int(existing.name.split("-")[1]) >= step:
                shutil.rmtree(existing)
        shutil.copytree(source, target)
    with (folder / ADOPTED).open("a") as record:
        record.write(json.dumps({"step": step, "from": str(checkpoint.path)}) + "\n")
    return str(target)


class RayReport(TrainerCallback):
    """Reports each evaluation's metrics to Ray Tune (the scheduler's input), with the trial's values; under PBT once
    the evaluation's checkpoint is saved and marked complete, with that checkpoint."""

    def __init__(self, with_checkpoints: bool, values: dict[str, Any]):
        self.with_checkpoints, self.values = with_checkpoints, values
        self.pending: dict[str, float] | None = None
        self.last_step: int | None = None

    def _result(self, state, metrics: dict[str, float]) -> dict[str, Any]:
        params = {f"{PARAM_PREFIX}{k}": v if isinstance(v, (int, float)) else json.dumps(v)
                  for k, v in self.values.items()}
        return {**{k: v for k, v in metrics.items() if isinstance(v, (int, float))}, "step": state.global_step,
                **params}

    @staticmethod
    def _record(args, result: dict[str, Any]) -> None:
        """The trial's own record of each report (its folder's reports.jsonl): Ray may drop the results before a
        restore from its history; this keeps them, for the learning curves and PBT's schedule."""
        with (Path(args.output_dir) / REPORTS).open("a") as record:
            record.write(json.dumps(result) + "\n")

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        from ray import tune

        if self.with_checkpoints and control.should_save:
            self.pending = self._result(state, metrics or {})
            return
        self.last_step = state.global_step
        result = self._result(state, metrics or {})
        self._record(args, result)
        tune.report(result)

    def on_save(self, args, state, control, **kwargs):
        from ray import tune

        if self.pending is None or not args.should_save:
            return
        checkpoint = Path(args.output_dir) / f"checkpoint-{state.global_step}"  # hf_tune's marker is written first
        result, self.pending, self.last_step = self.pending, None, state.global_step
        self._record(args, result)
        tune.report(result, checkpoint=tune.Checkpoint.from_directory(str(checkpoint)))
