"""Accuracy: the fraction of predictions equal to their references (an `evaluate` module, loaded by path offline)."""

import datasets
import evaluate
from sklearn.metrics import accuracy_score


class Accuracy(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=__doc__,
            citation="",
            inputs_description="predictions and references: lists of integer class ids",
            features=datasets.Features({"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}),
        )

    def _compute(self, predictions, references, sample_weight=None):
        return {"accuracy": float(accuracy_score(references, predictions, sample_weight=sample_weight))}
