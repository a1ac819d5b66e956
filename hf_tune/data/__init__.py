"""Datasets for training: loading, formats, tokenization with label masks, and the collator."""

from __future__ import annotations

import inspect

from datasets import Dataset
from transformers import DataCollatorWithPadding

from hf_tune.attention import default_attn_implementation, runs_examples_apart, supports_padding_free
from hf_tune.data.classification import label_names, tokenize_classification
from hf_tune.data.loading import load_raw_datasets, load_source
from hf_tune.data.packing import CausalLMCollator, causal_lm_loss, pack_by_token_budget
from hf_tune.data.tokenization import IGNORE_INDEX, tokenize_dataset
from hf_tune.recipe.loading import Recipe

__all__ = ["IGNORE_INDEX", "build_collator", "build_datasets", "causal_lm_loss", "data_seed", "dataset_labels",
           "supports_padding_free", "tokenize"]


def data_seed(recipe: Recipe) -> int:
    """``training.data_seed`` where set (0 included), else ``training.seed``, as Trainer's own samplers do."""
    seed = recipe.training.get("data_seed")
    return seed if seed is not None else recipe.training.get("seed", 42)


def dataset_labels(recipe: Recipe) -> list[str] | None:
    """Class names of a classification recipe, read from its training data; None for other formats."""
    if recipe.data.format != "classification":
        return None
    return label_names(load_source(recipe.data.train, "data.train", recipe.data.format))


def tokenize(recipe: Recipe, tokenizer, raw: Dataset, key: str, labels: list[str] | None = None) -> Dataset:
    if recipe.data.format == "classification":
        return tokenize_classification(raw, tokenizer, recipe.data, labels or dataset_labels(recipe), key)
    return tokenize_dataset(raw, tokenizer, recipe.data, key)


def build_datasets(recipe: Recipe, tokenizer, training_args=None) -> tuple[Dataset, Dataset | None]:
    """Tokenized train and eval datasets; with ``data.batch_tokens`` the training examples are grouped into packs.
    Under a distributed launcher the main process tokenizes first and the others read its cache."""

    def build():
        raw_train, raw_eval = load_raw_datasets(recipe.data, data_seed(recipe))
        labels = dataset_labels(recipe)
        train = tokenize(recipe, tokenizer, raw_train, "data.train", labels)
        if recipe.data.batch_tokens:
            train = pack_by_token_budget(train, recipe.data.batch_tokens, data_seed(recipe))
        evaluation = tokenize(recipe, tokenizer, raw_eval, "data.eval", labels) if raw_eval is not None else None
        return train, evaluation

    if training_args is None:
        return build()
    with training_args.main_process_first(desc="tokenizing datasets"):
        return build()


def build_collator(recipe: Recipe, tokenizer, model_class: type | None = None):
    """Classification: padded to the longest in the batch. Causal LM: padding-free when ``data.padding_free`` says so
    (default: where ``model_class`` supports it and it saves compute, see below), with the trained-positions mask when ``model.logits_to_keep:
    trained`` and the model's forward takes ``logits_to_keep``."""
    if recipe.data.format == "classification":
        return DataCollatorWithPadding(tokenizer)
    attention = recipe.model.attn_implementation or default_attn_implementation(recipe.model.task, model_class)
    apart = runs_examples_apart(attention)
    padding_free = recipe.data.padding_free
    if padding_free is None:
        # Flash attention and sdpa_varlen (the default) run each flattened example on its own. Plain SDPA and eager
        # compute the whole flattened row's scores under a block mask, which costs more than the little padding
        # left in length-grouped packs (measured: 155 vs 179 tokens/s), so packs stay padded there.
        padding_free = (model_class is not None and supports_padding_free(model_class)
                        and (apart or not recipe.data.batch_tokens))
    trained_only = (recipe.model.logits_to_keep == "trained" and model_class is not None
                    and "logits_to_keep" in inspect.signature(model_class.forward).parameters)
    return CausalLMCollator(tokenizer, padding_free, trained_only, example_boundaries=apart and padding_free)


