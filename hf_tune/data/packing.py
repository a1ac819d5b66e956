"""Token-budget packs: examples are grouped by length into packs of at most ``data.batch_tokens`` tokens, and one
pack is one training sample, so every step carries about the same number of tokens however long the examples are.
The collator (``data/collator.py``) turns a batch of packs back into examples."""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from datasets import Dataset
from datasets.fingerprint import Hasher

PACKING_VERSION = "3"  # bump when the packs change: cached packs are then never reused
_LENGTH_BATCH = 100_000  # rows whose lengths are read from Arrow at a time
_PACK_BATCH = 1_000  # packs gathered and written at a time


def pack_by_token_budget(dataset: Dataset, batch_tokens: int, seed: int) -> Dataset:
    """Group whole examples into packs of at most ``batch_tokens`` tokens; a pack row holds lists of examples.

    Examples are ordered by length (ties broken by a seeded shuffle) and filled greedily, so each pack holds
    examples of similar length and is nearly full. An example longer than the budget gets a pack of its own.

    Built at scale without holding tokens in Python: lengths are read from Arrow, the packs are index lists, and
    each pack's examples are copied from the tokenized dataset's Arrow buffers by a batched ``Dataset.map`` that
    writes the packs next to its cache (keyed by its fingerprint, the budget and the seed), so a second run, or
    another rank, reads the packs back.
    """
    lengths = example_lengths(dataset)
    packs = pack_indices(lengths, batch_tokens, seed)
    fingerprint = Hasher.hash([dataset._fingerprint, batch_tokens, seed, PACKING_VERSION])
    index = Dataset(pa.table({"examples": packs}), fingerprint=Hasher.hash([fingerprint, "index"]))
    cache_file = None
    if dataset.cache_files:
        cache_file = os.path.join(os.path.dirname(dataset.cache_files[0]["filename"]), f"packs-{fingerprint}.arrow")
    take_rows = ArrowRows(dataset, ("input_ids", "labels"))

    def gather(batch: pa.Table) -> pa.Table:
        examples = batch["examples"].combine_chunks()
        offsets = pc.subtract(examples.offsets, examples.offsets[0]).cast(pa.int32())
        rows = take_rows(pc.list_flatten(examples).to_numpy())
        return pa.table({name: pa.ListArray.from_arrays(offsets, column) for name, column in rows.items()})

    return index.with_format("arrow").map(
        gather, batched=True, batch_size=_PACK_BATCH, remove_columns=["examples"], new_fingerprint=fingerprint,
        cache_file_name=cache_file, desc=f"Packing into {batch_tokens}-token packs").with_format(None)


def example_lengths(dataset: Dataset) -> np.ndarray:
    """The token count of every example, read from Arrow batch by batch (no token becomes a Python int)."""
    parts = [pc.list_value_length(batch["input_ids"]).to_numpy(zero_copy_only=False)
             for batch in dataset.with_format("arrow").iter(batch_size=_LENGTH_BATCH)]
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)


def pack_indices(lengths: np.ndarray, batch_tokens: int, seed: int) -> pa.ListArray:
    """The examples of each pack: sorted by length after a seeded shuffle (the shuffle breaks ties), then filled
    greedily up to ``batch_tokens``."""
    order = np.random.default_rng(seed).permutation(len(lengths))
    order = order[np.argsort(lengths[order], kind="stable")]
    ends = np.cumsum(lengths[order])  # tokens up to and including each example, in packing order
    starts, position = [], 0
    while position < len(order):  # one step per pack: the pack runs to the last example that still fits
        starts.append(position)
        budget_end = (ends[position - 1] if position else 0) + batch_tokens
        position = max(position + 1, int(np.searchsorted(ends, budget_end, side="right")))
    offsets = np.asarray([*starts, len(order)], dtype=np.int64)
    return pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(order.astype(np.int64)))


class ArrowRows:
    """Rows of a dataset's list columns (token ids, labels) taken by row number, copied with numpy straight from
    the dataset's Arrow buffers: no Python object per row or token, and no copy of the whole table (Arrow's own
    ``take`` over a chunked list column concatenates every chunk first). Follows the dataset's indices mapping
    (``select``, ``shuffle``), so row ``i`` is ``dataset[i]``.
    """

    def __init__(self, dataset: Dataset, columns: tuple[str, ...]):
        self.mapping = dataset._indices.column(0).to_numpy().astype(np.int64) if dataset._indices is not None else None
        table = dataset.data.table.select(list(columns))
        chunks = table.to_batches()
        self.chunk_starts = np.cumsum([0] + [chunk.num_rows for chunk in chunks])
        self.value_types = {name: table.schema.field(name).type.value_type for name in columns}
        # per column: every chunk's values, and where each stored row's values start (within its chunk) and end;
        # columns with the same layout (labels beside input_ids) share it, and the copy's index arithmetic
        self.values, self.layouts = {}, {}
        for name in columns:
            self.values[name] = [chunk.column(name).values.to_numpy() for chunk in chunks]
            offsets = [chunk.column(name).offsets.to_numpy().astype(np.int64) for chunk in chunks]
            layout = (np.concatenate([o[:-1] for o in offsets] or [np.zeros(0, np.int64)]),
                      np.concatenate([np.diff(o) for o in offsets] or [np.zeros(0, np.int64)]))
            self.layouts[name] = next((known for known in self.layouts.values()
                                       if all(np.array_equal(x, y) for x, y in zip(known, layout))), layout)

    def __call__(self, rows: np.ndarray) -> dict[str, pa.Array]:
        rows = self.mapping[rows] if self.mapping is not None else np.asarray(rows, dtype=np.int64)
        chunk = np.searchsorted(self.chunk_starts, rows, side="right") - 1
        by_chunk = np.argsort(chunk, kind="stable")  # copy chunk by chunk, each row to its place in the output
        chunk_bounds = np.flatnonzero(np.diff(chunk[by_chunk], prepend=-1, append=len(self.chunk_starts)))
        chunk_ids = chunk[by_chunk[chunk_bounds[:-1]]]
        taken, copies = {}, {}
        for name, values_type in self.value_types.items():
            layout = self.layouts[name]
            if id(layout) not in copies:
                row_starts, row_lengths = layout
                lengths = row_lengths[rows]
                offsets = np.concatenate([[0], np.cumsum(lengths)])
                copies[id(layout)] = (
                    offsets, concatenated_ranges(row_starts[rows[by_chunk]], lengths[by_chunk]),
                    concatenated_ranges(offsets[:-1][by_chunk], lengths[by_chunk]),
                    np.concatenate([[0], np.cumsum(lengths[by_chunk])])[chunk_bounds])
            offsets, sources, targets, value_bounds = copies[id(layout)]
            values = np.empty(offsets[-1], dtype=values_type.to_pandas_dtype())
            for begin, end, chunk_id in zip(value_bounds[:-1], value_bounds[1:], chunk_ids):
                values[targets[begin:end]] = self.values[name][chunk_id][sources[begin:end]]
            taken[name] = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(values, values_type))
        return taken


def concatenated_ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``concatenate([arange(s, s + n) for s, n in zip(starts, lengths)])``, vectorized."""
    ends = np.cumsum(lengths)
    return np.repeat(starts - (ends - lengths), lengths) + np.arange(ends[-1] if len(ends) else 0)
