"""Sequence classification: label names from the training data, and text (+ text_pair) -> tokens + label id."""

from __future__ import annotations

from datasets import ClassLabel, Dataset
from datasets.fingerprint import Hasher

from hf_tune.data.formats import check_columns
from hf_tune.data.tokenization import TOKENIZATION_VERSION, tokenizer_fingerprint
from hf_tune.errors import RecipeError, stage_errors
from hf_tune.recipe.schema import DataSection


def label_names(raw_train: Dataset) -> list[str]:
    """Class names in id order: a ClassLabel's names, 0..max for integer labels, sorted strings otherwise."""
    feature = raw_train.features.get("label")
    if isinstance(feature, ClassLabel):
        return list(feature.names)
    values = raw_train.unique("label")
    if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        return [str(i) for i in range(max(values) + 1)]
    return sorted(str(v) for v in values)


def occurring_label_names(raw_train: Dataset) -> list[str]:
    """``label_names`` of the classes that occur in ``raw_train`` only (a ClassLabel's names without an example
    dropped, in id order)."""
    feature = raw_train.features.get("label")
    if not isinstance(feature, ClassLabel):
        return label_names(raw_train)
    present = set(raw_train.unique("label"))
    return [name for index, name in enumerate(feature.names) if index in present]


def tokenize_classification(raw: Dataset, tokenizer, data: DataSection, labels: list[str], key: str) -> Dataset:
    check_columns(data.format, raw.column_names, key)
    label2id = {name: i for i, name in enumerate(labels)}
    unknown = sorted({str(v) for v in raw.unique("label")} - label2id.keys()) if not isinstance(
        raw.features.get("label"), ClassLabel) else []
    if unknown:
        raise RecipeError(key, f"labels {unknown[:5]} do not occur in data.train (classes: {labels[:10]})",
                          fix="every eval label must be one of the training labels")
    pair = "text_pair" in raw.column_names

    def tokenize_batch(batch):
        encoded = tokenizer(batch["text"], batch["text_pair"] if pair else None, truncation=True,
                            max_length=data.max_length)
        encoded["labels"] = [label2id.get(str(v), v) for v in batch["label"]]
        return encoded

    fingerprint = Hasher.hash([raw._fingerprint, tokenizer_fingerprint(tokenizer), data.max_length, labels,
                               TOKENIZATION_VERSION, data.format])
    with stage_errors(key, f"tokenizing (format {data.format!r})"):
        return raw.map(tokenize_batch, batched=True, remove_columns=raw.column_names, new_fingerprint=fingerprint,
                       num_proc=data.num_proc, desc=f"Tokenizing {key} ({data.format})")
