"""Datasets for training: loading, formats, tokenization with label masks, and the collator."""

from __future__ import annotations

import dataclasses
import inspect

from datasets import Dataset
from transformers import DataCollatorWithPadding

from hf_tune.catalog.tasks import task_of
from hf_tune.data.classification import label_names, occurring_label_names
from hf_tune.data.collator import CausalLMCollator
from hf_tune.data.formats import format_of
from hf_tune.data.loading import load_raw_datasets, load_source
from hf_tune.data.mixture import build_mixture, source_section
from hf_tune.data.packing import pack_by_token_budget
from hf_tune.data.streaming import build_stream
from hf_tune.data.tokenization import IGNORE_INDEX, tokenize_dataset
from hf_tune.model.attention import default_attn_implementation, runs_examples_apart, supports_padding_free
from hf_tune.model.loss import causal_lm_loss
from hf_tune.model.meta import load_model_config
from hf_tune.recipe.schema import Recipe

__all__ = ["IGNORE_INDEX", "TrainingData", "build_collator", "build_datasets", "build_training_data",
           "causal_lm_loss", "data_seed", "dataset_labels", "supports_padding_free", "tokenize"]


def data_seed(recipe: Recipe) -> int:
    """``training.data_seed`` where set (0 included), else ``training.seed``, as Trainer's own samplers do."""
    seed = recipe.training.get("data_seed")
    return seed if seed is not None else recipe.training.get("seed", 42)


def dataset_labels(recipe: Recipe) -> list[str] | None:
    """Class names of a classification recipe, read from its training data; None for other formats."""
    if not format_of(recipe.data.format).class_labels:
        return None
    return class_names(recipe, load_source(recipe.data.train, "data.train", recipe.data.format))


def class_names(recipe: Recipe, raw_train: Dataset) -> list[str] | None:
    """The class names the model learns, from the raw training data (None where the format has no class labels).
    An image folder names its classes after the folders of every split (datasets' imagefolder): only the classes with
    a training image count, so an eval split holding another is refused as text data's is. Text labels keep the ids
    the data gives them."""
    fmt = format_of(recipe.data.format)
    if not fmt.class_labels:
        return None
    images = any(column.kind == "image" for column in fmt.columns)
    return occurring_label_names(raw_train) if images else label_names(raw_train)


def tokenize(recipe: Recipe, tokenizer, raw: Dataset, key: str, labels: list[str] | None = None) -> Dataset:
    task = task_of(recipe.model.task)
    if task.data_builder:
        return task.build_data(raw, tokenizer, recipe.data, labels or dataset_labels(recipe), key)
    return tokenize_dataset(raw, tokenizer, recipe.data, key)


@dataclasses.dataclass
class TrainingData:
    """Tokenized train and eval datasets, the class names of a classification recipe (None otherwise), and for a
    mixture each source's path, format, fingerprint and example count (``{"train[i]": {...}}``)."""

    train: Dataset
    eval: Dataset | None
    labels: list[str] | None
    sources: dict[str, dict] = dataclasses.field(default_factory=dict)  # a mixture: what each source gave


def build_training_data(recipe: Recipe, tokenizer, training_args=None) -> TrainingData:
    """Load the training source once (the class names come from it), split or load the eval data, tokenize both;
    with ``data.batch_tokens`` the training examples are grouped into packs. Under a distributed launcher the main
    process does it first and the others read its cache."""
    if training_args is None:
        return _build_training_data(recipe, tokenizer)
    with training_args.main_process_first(desc="tokenizing datasets"):
        return _build_training_data(recipe, tokenizer, training_args.process_index, training_args.world_size)


def _build_training_data(recipe: Recipe, tokenizer, rank: int = 0, world_size: int = 1) -> TrainingData:
    if recipe.data.streaming:
        data, evaluation = recipe.data, None
        if data.eval is not None:
            section = source_section(data, data.eval)
            evaluation = tokenize_dataset(load_source(data.eval, "data.eval", section.format), tokenizer, section,
                                          "data.eval")
        return TrainingData(build_stream(data, tokenizer, data_seed(recipe), rank, world_size), evaluation, None)
    if not task_of(recipe.model.task).data_builder:  # the causal LM formats: mixtures, packs
        mixture = build_mixture(recipe.data, tokenizer, data_seed(recipe))
        train = mixture.train
        if recipe.data.batch_tokens:
            train = pack_by_token_budget(train, recipe.data.batch_tokens, data_seed(recipe))
        return TrainingData(train, mixture.eval, None, mixture.sources)
    source = load_source(recipe.data.train, "data.train", recipe.data.format)
    labels = class_names(recipe, source)
    raw_train, raw_eval = load_raw_datasets(recipe.data, data_seed(recipe), train=source)
    train = tokenize(recipe, tokenizer, raw_train, "data.train", labels)
    evaluation = tokenize(recipe, tokenizer, raw_eval, "data.eval", labels) if raw_eval is not None else None
    return TrainingData(train, evaluation, labels)


def build_datasets(recipe: Recipe, tokenizer, training_args=None) -> tuple[Dataset, Dataset | None]:
    """Tokenized (train, eval) datasets: ``build_training_data`` without the class names."""
    data = build_training_data(recipe, tokenizer, training_args)
    return data.train, data.eval


def decide_padding_free(recipe: Recipe, model_class: type | None, attention: str | None, config=None) -> bool:
    """Whether a causal LM's batches are flattened rows (padding-free): ``data.padding_free``, else where it saves
    compute and the packing probe proved it exact. The one rule: the collator, ``plan`` and ``validate`` read it."""
    if recipe.data.padding_free is not None:
        return recipe.data.padding_free
    # Flash attention and sdpa_varlen (the default) run each flattened example on its own. Plain SDPA and eager
    # compute the whole flattened row's scores under a block mask, which costs more than the little padding
    # left in length-grouped packs (measured: docs/speed.md), so packs stay padded there. Either way, only
    # where a tiny model of the architecture gave each flattened example its own logits (packing_probe).
    return bool(model_class is not None and (runs_examples_apart(attention) or not recipe.data.batch_tokens)
                and supports_padding_free(model_class, attention, config))


def build_collator(recipe: Recipe, tokenizer, model_class: type | None = None,
                   attn_implementation: str | None = None, padding_free: bool | None = None):
    """Classification: padded to the longest in the batch. Causal LM: padding-free when ``data.padding_free`` says so
    (default: where ``model_class`` supports it and it saves compute, see below), with the trained-positions mask when
    ``model.logits_to_keep: trained`` and the model's forward takes ``logits_to_keep``. ``attn_implementation``: what
    the built model runs; ``padding_free``: the run's decision (``hf_tune.assembly.decisions``), decided here by the
    same rule when not given."""
    task = task_of(recipe.model.task)
    causal = task.causal
    if task.collator_class is not None:  # the task's own (images through the processor)
        return task.collator_class(tokenizer)
    if not causal:
        return DataCollatorWithPadding(tokenizer)
    attention = attn_implementation or recipe.model.attn_implementation
    if padding_free is None:
        config = load_model_config(recipe) if model_class is not None else None  # its layer kinds, for the probe
        attention = attention or default_attn_implementation(causal, model_class, config)
        padding_free = decide_padding_free(recipe, model_class, attention, config)
    apart = runs_examples_apart(attention)
    # Liger's patched forward (training.use_liger_kernel) slices hidden_states[:, logits_to_keep, :]: an integer or a
    # 1-D index, not the [batch, positions] mask, so under it the model projects all positions (or, with the chunked
    # loss, none: hf_tune.model.chunked_head.hidden_state_inputs)
    trained_only = (recipe.model.logits_to_keep == "trained" and model_class is not None
                    and "logits_to_keep" in inspect.signature(model_class.forward).parameters
                    and not recipe.training.get("use_liger_kernel"))
    return CausalLMCollator(tokenizer, padding_free, trained_only, example_boundaries=apart and padding_free)


