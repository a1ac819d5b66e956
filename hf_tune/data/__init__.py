"""Datasets for training: loading, formats, tokenization with label masks, and the collator."""

from __future__ import annotations

from datasets import Dataset
from transformers import DataCollatorForSeq2Seq

from hf_tune.data.loading import load_raw_datasets
from hf_tune.data.tokenization import IGNORE_INDEX, tokenize_dataset
from hf_tune.recipe.loading import Recipe

__all__ = ["IGNORE_INDEX", "build_collator", "build_datasets"]


def build_datasets(recipe: Recipe, tokenizer, training_args=None) -> tuple[Dataset, Dataset | None]:
    """Tokenized train and eval datasets. Under a distributed launcher the main process tokenizes first and the
    others read its cache."""
    seed = recipe.training.get("data_seed") or recipe.training.get("seed", 42)

    def build():
        raw_train, raw_eval = load_raw_datasets(recipe.data, seed)
        train = tokenize_dataset(raw_train, tokenizer, recipe.data, "data.train")
        evaluation = tokenize_dataset(raw_eval, tokenizer, recipe.data, "data.eval") if raw_eval is not None else None
        return train, evaluation

    if training_args is None:
        return build()
    with training_args.main_process_first(desc="tokenizing datasets"):
        return build()


def build_collator(tokenizer):
    """Pads input_ids with the pad token and labels with -100 (upstream ``DataCollatorForSeq2Seq``)."""
    return DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=IGNORE_INDEX)
