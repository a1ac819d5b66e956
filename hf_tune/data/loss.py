"""The causal LM loss and the positions it reads (those whose next token has a label): the collator's
``logits_to_keep`` mask, the trainer's loss and the throughput's trained-token count share them."""

from __future__ import annotations

import torch

from hf_tune.data.tokenization import IGNORE_INDEX


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
