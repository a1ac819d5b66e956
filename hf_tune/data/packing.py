"""Causal LM batches without wasted compute: padding-free flattening, token-budget packs, and the loss positions.

Padding-free: a batch is one row of concatenated examples whose ``position_ids`` restart at 0 for each example;
transformers turns those positions into a block-diagonal causal mask (SDPA, eager) or varlen kernels (flash
attention), so no example attends to another and no pad token is computed.

Token budget: examples are grouped by length into packs of at most ``data.batch_tokens`` tokens, and one pack is
one training sample, so every step carries about the same number of tokens however long the examples are.
"""

from __future__ import annotations

import os
import random
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from datasets import Dataset
from datasets.fingerprint import Hasher
from transformers import DataCollatorForSeq2Seq, DataCollatorWithFlattening

from hf_tune.data.tokenization import IGNORE_INDEX


PACKING_VERSION = "2"  # bump when the packs change: cached packs are then never reused
_LENGTH_BATCH = 100_000  # rows whose lengths are read from Arrow at a time
_PACK_BATCH = 1_000  # packs gathered and written at a time


def pack_by_token_budget(dataset: Dataset, batch_tokens: int, seed: int) -> Dataset:
    """Group whole examples into packs of at most ``batch_tokens`` tokens; a pack row holds lists of examples.

    Examples are ordered by length (ties broken by a seeded shuffle) and filled greedily, so each pack holds
    examples of similar length and is nearly full. An example longer than the budget gets a pack of its own.

    Built at scale without holding tokens in Python: lengths are read from Arrow, the packs are index lists, and
    each pack's examples are gathered from the tokenized dataset in Arrow batches and written next to its cache
    (keyed by its fingerprint, the budget and the seed), so a second run, or another rank, reads the packs back.
    """
    lengths = example_lengths(dataset)
    packs = pack_indices(lengths, batch_tokens, seed)
    fingerprint = Hasher.hash([dataset._fingerprint, batch_tokens, seed, PACKING_VERSION])
    index = Dataset(pa.table({"examples": packs}), fingerprint=Hasher.hash([fingerprint, "index"]))
    cache_file = None
    if dataset.cache_files:
        cache_file = os.path.join(os.path.dirname(dataset.cache_files[0]["filename"]), f"packs-{fingerprint}.arrow")
    source = dataset.with_format("arrow")

    def gather(batch: pa.Table) -> pa.Table:
        examples = batch["examples"].combine_chunks()
        offsets = pc.subtract(examples.offsets, examples.offsets[0])
        rows = source[pc.list_flatten(examples).to_pylist()]
        return pa.table({name: pa.ListArray.from_arrays(offsets, rows[name].combine_chunks())
                         for name in ("input_ids", "labels")})

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
    order = list(range(len(lengths)))
    random.Random(seed).shuffle(order)
    order = np.asarray(order, dtype=np.int64)
    order = order[np.argsort(lengths[order], kind="stable")]
    starts, filled = [], batch_tokens
    for position, n in enumerate(lengths[order].tolist()):
        if filled + n > batch_tokens:
            starts.append(position)
            filled = 0
        filled += n
    offsets = np.asarray([*starts, len(order)], dtype=np.int64) if len(order) else np.zeros(1, dtype=np.int64)
    return pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(order))


def unpack_features(features: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Examples of a batch whose rows may be packs (lists of examples) or single examples."""
    examples = []
    for row in features:
        ids = row["input_ids"]
        if len(ids) and isinstance(ids[0], list):
            examples += [{"input_ids": i, "labels": l} for i, l in zip(ids, row["labels"])]
        else:
            examples.append(row)
    return examples


class CausalLMCollator:
    """Batches for causal LM training.

    ``padding_free``: one flattened row with restarting ``position_ids`` (upstream ``DataCollatorWithFlattening``);
    otherwise rows padded to the longest (labels padded with -100). ``trainable_logits_only``: adds
    ``logits_to_keep``, the boolean mask of positions whose next token is trained, so the model projects only those
    hidden states onto the vocabulary (the LM head is a large share of a small model's compute and memory).
    ``example_boundaries``: a flattened batch also carries ``cu_seq_lens_*`` / ``max_length_*``, which varlen
    attention (flash attention, ``sdpa_varlen``) reads to run each example on its own.
    """

    def __init__(self, tokenizer, padding_free: bool, trainable_logits_only: bool, example_boundaries: bool = False):
        self.padding_free = padding_free
        self.trainable_logits_only = trainable_logits_only
        if padding_free:
            self.inner = DataCollatorWithFlattening(return_flash_attn_kwargs=example_boundaries)
        else:
            self.inner = DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=IGNORE_INDEX)

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        examples = unpack_features(features)
        if self.padding_free:
            examples = [{"input_ids": e["input_ids"], "labels": e["labels"]} for e in examples]
        batch = self.inner(examples)
        # Without it, transformers 5 builds a KV cache in training forwards too, and with a cache present its masks
        # ignore restarting position_ids: flattened examples then attend to each other (measured on Llama, SDPA
        # and eager; tests/test_packing.py). Training never reads the cache anyway.
        batch["use_cache"] = False
        if self.trainable_logits_only:
            batch["logits_to_keep"] = next_token_trained(batch["labels"])
        return batch


def next_token_trained(labels: torch.Tensor) -> torch.Tensor:
    """Boolean mask of the positions whose next token has a label (the positions a causal LM loss reads)."""
    shifted = torch.nn.functional.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX)
    return shifted != IGNORE_INDEX


def causal_lm_loss(outputs, labels: torch.Tensor, num_items_in_batch: torch.Tensor | int | None = None
                   ) -> torch.Tensor:
    """Next-token cross-entropy, in fp32, summed over trained tokens and divided by ``num_items_in_batch`` (the
    trained tokens of the whole accumulated batch, counted by Trainer) or averaged when that is not given.

    Logits may cover every position (``[batch, seq, vocab]``) or only the trained ones (``[n, vocab]``, from
    ``logits_to_keep``); both give the same loss.
    """
    logits = outputs["logits"]
    trained = next_token_trained(labels)
    targets = torch.nn.functional.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX)[trained]
    if logits.dim() == 3:
        logits = logits[trained.to(logits.device)]
    total = torch.nn.functional.cross_entropy(logits.float(), targets.to(logits.device), reduction="sum")
    if num_items_in_batch is None:
        return total / max(targets.numel(), 1)
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch
