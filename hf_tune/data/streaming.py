"""``data.streaming: true``: the training examples as an ``IterableDataset``, read, tokenized and packed as Trainer
consumes them, for data too large to tokenize ahead.

The stream is read in the order of its files (shuffle them ahead if the order matters); a mixture's sources are
interleaved by their weights, seeded. With ``data.batch_tokens`` each window of ``STREAM_PACK_WINDOW`` tokenized
examples is packed by the rule of ``pack_by_token_budget`` (seeded, sorted by length, filled greedily), so packs are
as full as in a map-style run while no more than a window is held. Trainer needs ``max_steps`` (checked when the
recipe loads). Resuming replays the stream deterministically and Trainer skips the batches already trained, so a
resumed run sees what an uninterrupted one would (tests/test_streaming.py).

Under several ranks each reads its share (``split_by_rank``): whole files when every source has at least as many
files (shards) as there are ranks, which accelerate assigns; otherwise every rank reads the files but keeps one
example in ``world_size`` before tokenizing, so tokenizing and packing are shared out too.
"""

from __future__ import annotations

import functools

from datasets import IterableDataset, interleave_datasets
from datasets.distributed import split_dataset_by_node

from hf_tune.data.formats import check_columns
from hf_tune.data.loading import describe_source, load_source
from hf_tune.data.messages import load_tools
from hf_tune.data.mixture import source_section
from hf_tune.data.packing import pack_indices
from hf_tune.data.tokenization import batch_tokenizer
from hf_tune.errors import RecipeError
from hf_tune.recipe.schema import DataSection

STREAM_PACK_WINDOW = 1_000  # tokenized examples packed together


def build_stream(data: DataSection, tokenizer, seed: int, rank: int = 0, world_size: int = 1) -> IterableDataset:
    """The training stream of this rank (``rank`` of ``world_size``; see the module's docstring)."""
    raws = [load_source(source, key, streaming=True) for key, source in data.train_sources]
    if split_by_rank(raws, world_size):
        raws = [split_dataset_by_node(raw, rank=rank, world_size=world_size) for raw in raws]
    parts = []
    for (key, source), raw in zip(data.train_sources, raws):
        section = source_section(data, source)
        columns = raw.column_names or list(next(iter(raw)).keys())
        if source.columns:
            missing = [theirs for theirs in source.columns.values() if theirs not in columns]
            if missing:
                raise RecipeError(f"{key}.columns", f"{describe_source(source)} has no column {missing[0]!r}; its "
                                  f"columns are {columns}", fix="map each of the format's columns to one of these")
            renames = {theirs: ours for ours, theirs in source.columns.items() if theirs != ours}
            displaced = [ours for ours in renames.values() if ours in columns and ours not in renames]
            raw = raw.remove_columns(displaced).rename_columns(renames)
            columns = [renames.get(c, c) for c in columns if c not in displaced]
        check_columns(section.format, columns, key, describe_source(source))
        parts.append(raw.map(batch_tokenizer(tokenizer, section, load_tools(data.tools)), batched=True,
                             remove_columns=columns))
    if len(parts) == 1:
        stream = parts[0]
    else:
        weights = [source.weight or 1.0 for _, source in data.train_sources]
        stream = interleave_datasets(parts, probabilities=[w / sum(weights) for w in weights], seed=seed,
                                     stopping_strategy=data.stopping_strategy)
    if data.batch_tokens:
        stream = stream.map(functools.partial(pack_window, batch_tokens=data.batch_tokens, seed=seed), batched=True,
                            batch_size=STREAM_PACK_WINDOW, remove_columns=["input_ids", "attention_mask", "labels"])
    return stream


def split_by_rank(raws: list[IterableDataset], world_size: int) -> bool:
    """Whether hf_tune splits the raw stream between ranks itself (before tokenizing), rather than accelerate.

    accelerate (with ``dispatch_batches`` off, as hf_tune sets it for a stream) gives each rank its own files when
    the stream has at least one per rank; with fewer, every rank would read, tokenize and pack the whole stream and
    keep one batch in ``world_size``. hf_tune splits that case by example instead, before tokenizing, and
    ``HfTuneMixin.get_train_dataloader`` then keeps accelerate from splitting the rank's share a second time."""
    return world_size > 1 and min(raw.num_shards for raw in raws) < world_size


def split_by_hf_tune(dataset) -> bool:
    """A stream that ``build_stream`` already split between ranks."""
    return isinstance(dataset, IterableDataset) and dataset._distributed is not None


def pack_window(batch: dict[str, list], batch_tokens: int, seed: int) -> dict[str, list]:
    """One window of tokenized examples as packs (lists of examples), by ``pack_by_token_budget``'s rule."""
    import numpy as np

    packs = pack_indices(np.asarray([len(ids) for ids in batch["input_ids"]], dtype=np.int64), batch_tokens,
                         seed).to_pylist()
    return {name: [[batch[name][i] for i in pack] for pack in packs] for name in ("input_ids", "labels")}
