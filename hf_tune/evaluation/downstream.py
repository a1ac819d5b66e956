"""Downstream scores at each evaluation: the recipe's lm-eval tasks scored on the model in memory and added to the
evaluation's metrics (``HfTuneMixin.evaluation_loop`` asks this callback, handed to the trainer in its monitors), so
they are logged with eval_loss and read by ``metric_for_best_model``, early stopping and a search.

Under DDP the main process scores its (unwrapped, whole) copy of the model and the other ranks receive the scores:
lm-eval cannot split requests across the ranks of a model it did not load itself. The recipe refuses tasks under
FSDP or DeepSpeed, where no rank holds the whole model (``hf-tune eval --watch`` scores the checkpoints instead).
"""

from __future__ import annotations

import time

from transformers import TrainerCallback

from hf_tune.evaluation.harness import Harness, build_harness
from hf_tune.evaluation.samples import GenerationSamples


class DownstreamScores(TrainerCallback):
    """The recipe's harness (built at the first evaluation), asked for scores by ``HfTuneMixin.evaluation_loop``."""

    def __init__(self, evaluation, seed: int = 0):
        self.evaluation, self.seed = evaluation, seed
        self._harness: Harness | None = None

    @property
    def harness(self) -> Harness:
        if self._harness is None:
            self._harness = build_harness(self.evaluation, self.seed)
        return self._harness

    def metrics(self, model, tokenizer, accelerator, prefix: str = "eval") -> dict[str, float]:
        """``{prefix}_<task>_<metric>`` of ``model``, the same on every rank, and ``{prefix}_downstream_runtime``
        (seconds the main process spent scoring)."""
        scores = None
        if accelerator.is_main_process:
            start = time.perf_counter()
            scores = {f"{prefix}_{name}": value for name, value in self.harness.score(model, tokenizer).items()}
            scores[f"{prefix}_downstream_runtime"] = round(time.perf_counter() - start, 4)
        if accelerator.num_processes > 1:
            from accelerate.utils import broadcast_object_list

            scores = broadcast_object_list([scores])[0]
        return scores


def build_downstream_scores(recipe) -> DownstreamScores | None:
    """The downstream scores of a recipe (``evaluation.tasks``), None without tasks."""
    return (DownstreamScores(recipe.evaluation, int(recipe.training.get("seed", 42))) if recipe.evaluation.tasks
            else None)


def build_sample_callbacks(recipe) -> list[TrainerCallback]:
    """The generation samples of a recipe (``evaluation.samples``) as callbacks, none without them."""

    if not recipe.evaluation.samples:
        return []
    return [GenerationSamples(recipe.evaluation.samples, recipe.evaluation.sample_max_new_tokens)]
