"""Training data from one source or a mixture of several, each with its own format and columns, tokenized apart
and then mixed: by ``weight`` (``datasets.interleave_datasets`` probabilities, seeded, ``data.stopping_strategy``),
or by ``epochs`` (passes over each source: 2 repeats every example, 0.5 takes a seeded half), else concatenated.

Every step is seeded and deterministic, and runs under ``main_process_first`` with the tokenization, so every rank
gets the same mixture. How many examples each source gave is counted and written to the manifest.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from datasets import Dataset, concatenate_datasets, interleave_datasets

from hf_tune.data.loading import load_source
from hf_tune.data.tokenization import tokenize_dataset
from hf_tune.recipe.schema import DataSection, DatasetSource

SOURCE_COLUMN = "hf_tune_source"  # the source index of each example while mixing; removed after counting


@dataclasses.dataclass
class Mixture:
    """Tokenized train and eval data, and what each training source gave (``{"train[i]": {...}}``, for the manifest;
    empty for a single source)."""

    train: Dataset
    eval: Dataset | None
    sources: dict[str, dict]


def build_mixture(data: DataSection, tokenizer, seed: int) -> Mixture:
    """Load, check and tokenize each training source in its own format; ``eval_split`` holds out a seeded fraction
    of each; then mix them."""
    parts, held_out, described = [], [], []
    for key, source in data.train_sources:
        section = source_section(data, source)
        raw = load_source(source, key, section.format)
        described.append({"path": source.path, "split": source.split, "format": section.format,
                          "fingerprint": raw._fingerprint})
        if data.eval_split:
            split = raw.train_test_split(test_size=data.eval_split, seed=seed)
            raw = split["train"]
            held_out.append(tokenize_dataset(split["test"], tokenizer, section, key.replace("train", "eval", 1)))
        parts.append(tokenize_dataset(raw, tokenizer, section, key))
    train, counts = mix(parts, [source for _, source in data.train_sources], data, seed)
    evaluation = None
    if data.eval is not None:
        section = source_section(data, data.eval)
        evaluation = tokenize_dataset(load_source(data.eval, "data.eval", section.format), tokenizer, section,
                                      "data.eval")
    elif held_out:
        evaluation = held_out[0] if len(held_out) == 1 else concatenate_datasets(held_out)
    sources = {}
    if isinstance(data.train, list):
        sources = {f"train[{i}]": {**about, "examples": count}
                   for i, (about, count) in enumerate(zip(described, counts))}
    return Mixture(train, evaluation, sources)


def source_section(data: DataSection, source: DatasetSource) -> DataSection:
    """The data section as one source sees it: its own format where it names one."""
    return data if source.format in (None, data.format) else data.model_copy(update={"format": source.format})


def mix(parts: list[Dataset], sources: list[DatasetSource], data: DataSection, seed: int
        ) -> tuple[Dataset, list[int]]:
    """The mixture and the number of examples each part gave to it."""
    if any(source.weight is not None for source in sources):
        total = sum(source.weight for source in sources)
        tagged = [part.add_column(SOURCE_COLUMN, np.full(len(part), i, dtype=np.int32)) for i, part in enumerate(parts)]
        mixed = interleave_datasets(tagged, probabilities=[source.weight / total for source in sources], seed=seed,
                                    stopping_strategy=data.stopping_strategy)
        origin = mixed.with_format("numpy")[SOURCE_COLUMN]
        return mixed.remove_columns(SOURCE_COLUMN), np.bincount(origin, minlength=len(parts)).tolist()
    parts = [repeat(part, source.epochs, seed + i) if source.epochs not in (None, 1) else part
             for i, (part, source) in enumerate(zip(parts, sources))]
    return (parts[0] if len(parts) == 1 else concatenate_datasets(parts)), [len(part) for part in parts]


def repeat(dataset: Dataset, epochs: float, seed: int) -> Dataset:
    """``epochs`` passes over ``dataset``: every example ``int(epochs)`` times, then a seeded sample of the rest."""
    n = len(dataset)
    whole, rest = int(epochs), round((epochs - int(epochs)) * n)
    indices = np.concatenate([np.tile(np.arange(n), whole), np.random.default_rng(seed).permutation(n)[:rest]])
    return dataset.select(indices)
