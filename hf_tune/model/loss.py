"""The causal LM loss and the positions it reads (those whose next token has a label): the collator's
``logits_to_keep`` mask, the trainer's loss and the throughput's trained-token count share them. With
``model.chunked_loss`` the same loss is computed from the last hidden state and the LM head a chunk of positions at a
time (``ChunkedCausalLMLoss``)."""

from __future__ import annotations

import torch

from hf_tune.model.chunked_logprobs import IGNORE_INDEX, LogitHead


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
    return per_item(total, targets.numel(), num_items_in_batch)


def per_item(total: torch.Tensor, trained: int, num_items_in_batch: torch.Tensor | int | None) -> torch.Tensor:
    """A summed loss divided by ``num_items_in_batch``, or by this batch's ``trained`` tokens when not given."""
    if num_items_in_batch is None:
        return total / max(trained, 1)
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


class ChunkedCausalLMLoss:
    """``causal_lm_loss`` from the last hidden state and the LM head, a chunk of positions at a time with the logits
    recomputed in backward (hf_tune.model.chunked_logprobs): no ``[positions, vocabulary]`` tensor. Training forwards
    ask for hidden states and one position's logits a row (``hf_tune.model.chunked_head.hidden_state_inputs``); a
    forward without hidden states (evaluation) gets ``causal_lm_loss`` on its logits. ``chunk_size``: positions a
    chunk (default: ``chunked_logprobs.default_chunk_size``, a fixed number of logits a chunk)."""

    def __init__(self, head: LogitHead, chunk_size: int | None = None):
        self.head = head
        self.chunk_size = chunk_size

    def __call__(self, outputs, labels: torch.Tensor, num_items_in_batch: torch.Tensor | int | None = None
                 ) -> torch.Tensor:
        hidden_states = outputs.get("hidden_states")
        if hidden_states is None:
            return causal_lm_loss(outputs, labels, num_items_in_batch)
        last = hidden_states[-1]
        targets = torch.nn.functional.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX).to(last.device)
        total = -self.head.target_logprobs(last, targets, self.chunk_size).sum()
        trained = int((targets != IGNORE_INDEX).sum()) if num_items_in_batch is None else 0  # Trainer gives it
        return per_item(total, trained, num_items_in_batch)


class RouterBalancedLoss:
    """A causal LM loss plus a mixture of experts' load-balancing loss (the model's ``aux_loss``, from its router
    logits: ``output_router_logits``) times ``coefficient``, in training forwards; evaluation's loss stays the
    cross-entropy. Each micro-batch's term is weighted by its share of the accumulated batch's trained tokens (the
    weight the cross-entropy gives its tokens), so an optimizer step adds ``coefficient`` times the token-weighted mean
    of its micro-batches' router losses, whatever the accumulation. The router loss of each training micro-batch is
    kept for the log (``pop_logs``: its mean since the last log, ``router_aux_loss``)."""

    def __init__(self, inner, coefficient: float):
        self.inner, self.coefficient = inner, coefficient
        self._sum, self._count = 0.0, 0

    @property
    def chunked(self) -> bool:
        return isinstance(self.inner, ChunkedCausalLMLoss)

    def __call__(self, outputs, labels: torch.Tensor, num_items_in_batch: torch.Tensor | int | None = None
                 ) -> torch.Tensor:
        loss = self.inner(outputs, labels, num_items_in_batch)
        aux = outputs.get("aux_loss")
        if aux is None or not torch.is_grad_enabled():
            return loss
        aux = aux.to(loss.device)
        self._sum, self._count = self._sum + aux.detach(), self._count + 1
        weight = 1.0 if num_items_in_batch is None else next_token_trained(labels).sum().to(loss.device) / (
            num_items_in_batch.to(loss.device) if torch.is_tensor(num_items_in_batch) else num_items_in_batch)
        return loss + self.coefficient * aux * weight

    def pop_logs(self) -> dict[str, float]:
        """``router_aux_loss``: the mean router loss of the training micro-batches since the last call (this rank's)."""
        if not self._count:
            return {}
        mean = float(self._sum) / self._count
        self._sum, self._count = 0.0, 0
        return {"router_aux_loss": mean}


def is_chunked(loss_func) -> bool:
    """Whether a trainer's loss is the chunked one (alone or under the router's term)."""
    return isinstance(loss_func, ChunkedCausalLMLoss) or bool(getattr(loss_func, "chunked", False))
