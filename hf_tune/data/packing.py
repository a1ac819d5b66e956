"""Causal LM batches without wasted compute: padding-free flattening, token-budget packs, and the loss positions.

Padding-free: a batch is one row of concatenated examples whose ``position_ids`` restart at 0 for each example;
transformers turns those positions into a block-diagonal causal mask (SDPA, eager) or varlen kernels (flash
attention), so no example attends to another and no pad token is computed.

Token budget: examples are grouped by length into packs of at most ``data.batch_tokens`` tokens, and one pack is
one training sample, so every step carries about the same number of tokens however long the examples are.
"""

from __future__ import annotations

import random
from typing import Any

import torch
from datasets import Dataset
from transformers import DataCollatorForSeq2Seq, DataCollatorWithFlattening

from hf_tune.data.tokenization import IGNORE_INDEX


def pack_by_token_budget(dataset: Dataset, batch_tokens: int, seed: int) -> Dataset:
    """Group whole examples into packs of at most ``batch_tokens`` tokens; a pack row holds lists of examples.

    Examples are ordered by length (ties broken by a seeded shuffle) and filled greedily, so each pack holds
    examples of similar length and is nearly full. An example longer than the budget gets a pack of its own.
    """
    lengths = [len(ids) for ids in dataset["input_ids"]]
    order = list(range(len(lengths)))
    random.Random(seed).shuffle(order)
    order.sort(key=lengths.__getitem__)
    packs: list[list[int]] = []
    filled = batch_tokens
    for i in order:
        if filled + lengths[i] > batch_tokens:
            packs.append([])
            filled = 0
        packs[-1].append(i)
        filled += lengths[i]
    columns = {name: dataset[name] for name in ("input_ids", "labels")}
    return Dataset.from_dict({name: [[values[i] for i in pack] for pack in packs] for name, values in columns.items()})


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
