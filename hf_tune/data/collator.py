"""Causal LM batches without wasted compute: padding-free flattening or padding, and the trained-positions mask.

Padding-free: a batch is one row of concatenated examples whose ``position_ids`` restart at 0 for each example;
transformers turns those positions into a block-diagonal causal mask (SDPA, eager) or varlen kernels (flash
attention), so no example attends to another and no pad token is computed.
"""

from __future__ import annotations

from typing import Any

from transformers import DataCollatorForSeq2Seq, DataCollatorWithFlattening

from hf_tune.data.tokenization import IGNORE_INDEX
from hf_tune.model.loss import next_token_trained


def unpack_features(features: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Examples of a batch whose rows may be packs (lists of examples) or single examples."""
    examples = []
    for row in features:
        ids = row["input_ids"]
        if len(ids) and isinstance(ids[0], list):
            examples += [{"input_ids": i, "labels": labels} for i, labels in zip(ids, row["labels"])]
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
