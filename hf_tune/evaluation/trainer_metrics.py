"""Metrics at evaluation (``evaluate`` modules, the shipped ones loaded by path so they work offline) and early
stopping (upstream ``EarlyStoppingCallback``)."""

from __future__ import annotations

import numpy as np
from transformers import EarlyStoppingCallback, EvalPrediction

from hf_tune.metrics import SHIPPED_METRICS, metric_path  # noqa: F401  (re-exported)
from hf_tune.recipe.schema import EvaluationSection


def build_compute_metrics(evaluation: EvaluationSection):
    """``compute_metrics`` for Trainer: argmax of the logits against the labels, for every named metric."""
    if not evaluation.metrics:
        return None
    import evaluate

    metrics = [evaluate.load(metric_path(name)) for name in evaluation.metrics]

    def compute_metrics(prediction: EvalPrediction) -> dict[str, float]:
        logits = prediction.predictions[0] if isinstance(prediction.predictions, tuple) else prediction.predictions
        predicted = np.asarray(logits).argmax(-1)
        results: dict[str, float] = {}
        for metric in metrics:
            results.update(metric.compute(predictions=predicted, references=prediction.label_ids))
        return results

    return compute_metrics


def build_callbacks(evaluation: EvaluationSection) -> list:
    if evaluation.early_stopping_patience is None:
        return []
    return [EarlyStoppingCallback(early_stopping_patience=evaluation.early_stopping_patience,
                                  early_stopping_threshold=evaluation.early_stopping_threshold)]
