"""Datasets for training: loading, formats, tokenization with label masks, and the collator."""

from __future__ import annotations

from datasets import Dataset
from transformers import DataCollatorForSeq2Seq, DataCollatorWithPadding

from hf_tune.data.classification import label_names, tokenize_classification
from hf_tune.data.loading import load_raw_datasets, load_source
from hf_tune.data.tokenization import IGNORE_INDEX, tokenize_dataset
from hf_tune.recipe.loading import Recipe

__all__ = ["IGNORE_INDEX", "build_collator", "build_datasets", "data_seed", "dataset_labels", "tokenize"]


def data_seed(recipe: Recipe) -> int:
    return recipe.training.get("data_seed") or recipe.training.get("seed", 42)


def dataset_labels(recipe: Recipe) -> list[str] | None:
    """Class names of a classification recipe, read from its training data; None for other formats."""
    if recipe.data.format != "classification":
        return None
    return label_names(load_source(recipe.data.train, "data.train"))


def tokenize(recipe: Recipe, tokenizer, raw: Dataset, key: str, labels: list[str] | None = None) -> Dataset:
    if recipe.data.format == "classification":
        return tokenize_classification(raw, tokenizer, recipe.data, labels or dataset_labels(recipe), key)
    return tokenize_dataset(raw, tokenizer, recipe.data, key)


def build_datasets(recipe: Recipe, tokenizer, training_args=None) -> tuple[Dataset, Dataset | None]:
    """Tokenized train and eval datasets. Under a distributed launcher the main process tokenizes first and the
    others read its cache."""

    def build():
        raw_train, raw_eval = load_raw_datasets(recipe.data, data_seed(recipe))
        labels = dataset_labels(recipe)
        train = tokenize(recipe, tokenizer, raw_train, "data.train", labels)
        evaluation = tokenize(recipe, tokenizer, raw_eval, "data.eval", labels) if raw_eval is not None else None
        return train, evaluation

    if training_args is None:
        return build()
    with training_args.main_process_first(desc="tokenizing datasets"):
        return build()


def build_collator(recipe: Recipe, tokenizer):
    """Pads to the longest in the batch: labels with -100 for text formats, class ids as they are for classification."""
    if recipe.data.format == "classification":
        return DataCollatorWithPadding(tokenizer)
    return DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=IGNORE_INDEX)
