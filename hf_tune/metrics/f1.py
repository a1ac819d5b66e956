"""F1 score, macro-averaged over classes by default (an `evaluate` module, loaded by path offline)."""

import datasets
import evaluate
from sklearn.metrics import f1_score


class F1(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=__doc__,
            citation="",
            inputs_description="predictions and references: lists of integer class ids; average: macro|micro|weighted",
            features=datasets.Features({"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}),
        )

    def _compute(self, predictions, references, average="macro", labels=None):
        return {"f1": float(f1_score(references, predictions, average=average, labels=labels, zero_division=0))}
