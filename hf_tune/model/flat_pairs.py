"""Padding-free preference batches: the chosen and rejected sequences of every pair run as one flattened row.

TRL's ``DPOTrainer`` pads a batch of pairs to ``[2 x pairs, longest]`` (chosen rows, then rejected rows) and asks
the model for per-token log-probabilities through the forward its ``add_fused_lm_head`` patches in
(``model(..., labels=, fused_lm_head=True)``). TRL 1.16 accepts ``padding_free`` for DPO and turns it off. Here that
forward is replaced, on the model TRL patched, by one that drops the pad tokens before the backbone: the real tokens
of every row are flattened into one row with restarting ``position_ids`` (and, for varlen attention, the rows'
boundaries), so every sequence attends to itself only, as hf_tune's SFT packs do (``hf_tune.model.attention``). The
log-probabilities (and the statistics TRL logs) come from hf_tune's chunked head (``chunked_logprobs``: no
``[tokens, vocabulary]`` tensor, 128 MiB of logits a chunk) and are scattered back to TRL's padded layout, so TRL's
loss, its reference pass and its metrics run unchanged. A call this does not cover (images, router logits,
pre-shifted labels) goes to TRL's forward.

``check_flat_pairs`` proves it on the model before training: two pairs of a tiny padded batch give the same
per-token log-probabilities as the model's own padded forward, within the rounding of the head's dtype.
"""

from __future__ import annotations

import functools
import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.utils import ModelOutput

from hf_tune.errors import RecipeError
from hf_tune.model.chunked_logprobs import IGNORE_INDEX, LogitHead, chunked_target_stats

KEY = "training.padding_free"
# model inputs a flattened row carries over from TRL's padded batch; any other one with a value (pixel values,
# router logits asked for, hidden states asked for) keeps the call on TRL's forward
_FLATTENED = frozenset({"input_ids", "attention_mask", "use_cache"})


@dataclass
class FlatPairsOutput(ModelOutput):
    """What TRL's fused forward returns (``trl.trainer.utils.FusedCausalLMOutput``'s fields that DPO reads), in the
    padded layout ``[rows, longest - 1]``: zero where the next token has no label."""

    loss: torch.Tensor | None = None
    log_probs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    mean_logits: torch.Tensor | None = None
    is_top1: torch.Tensor | None = None
    label_mask: torch.Tensor | None = None
    log_sum_sq_probs: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None


def flattened_inputs(input_ids: torch.Tensor, attention_mask: torch.Tensor, example_boundaries: bool) -> dict:
    """The backbone's inputs for a right- or left-padded ``[rows, length]`` batch as one row of its real tokens:
    ``position_ids`` restarting at each row, and with ``example_boundaries`` the ``cu_seq_lens_*`` / ``max_length_*``
    that varlen attention reads (as ``DataCollatorWithFlattening`` writes them)."""
    mask = attention_mask.bool()
    inputs = {"input_ids": input_ids[mask][None], "position_ids": (mask.cumsum(1) - 1)[mask][None],
              "use_cache": False}
    if example_boundaries:
        lengths = mask.sum(1)
        starts = F.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
        longest = int(lengths.max())
        inputs.update(cu_seq_lens_q=starts, cu_seq_lens_k=starts, max_length_q=longest, max_length_k=longest)
    return inputs


def flat_pairs_forward(model, head: LogitHead, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                       labels: torch.Tensor, num_items_in_batch=None, example_boundaries: bool = True
                       ) -> FlatPairsOutput:
    """Per-token log-probabilities of ``labels`` (each row's next token; -100 unscored) from one flattened row."""
    mask = attention_mask.bool()
    hidden = model.base_model(**flattened_inputs(input_ids, attention_mask, example_boundaries)).last_hidden_state
    weight = head.linear.weight
    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)[mask].to(weight.device)  # the same row's next token
    stats = chunked_target_stats(hidden[0].to(weight.device), weight, targets, head.linear.bias,
                                 logit_scale=head.logit_scale, softcap=head.softcap)
    flat_mask = mask.to(weight.device)

    def padded(values: torch.Tensor) -> torch.Tensor:  # the flattened row's values back in TRL's [rows, length - 1]
        return values.new_zeros(flat_mask.shape).masked_scatter(flat_mask, values)[:, :-1]

    label_mask = labels[:, 1:].to(weight.device) != IGNORE_INDEX
    log_probs = padded(stats.logprobs)
    scored = label_mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    return FlatPairsOutput(loss=-log_probs.sum() / scored, log_probs=log_probs, entropy=padded(stats.entropy),
                           mean_logits=padded(stats.mean_logits), is_top1=padded(stats.is_top1),
                           label_mask=label_mask)


def install_flat_pairs(model, head: LogitHead, example_boundaries: bool) -> None:
    """Replace the fused forward TRL patched onto ``model`` (``add_fused_lm_head``) by the flattened one; the calls
    it does not cover go to TRL's. ``uninstall_flat_pairs`` restores TRL's."""
    padded_forward = model.forward

    @functools.wraps(type(model).forward)  # the signature generate() validates its kwargs against
    def forward(self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None, **kwargs):
        given = {name: value for name, value in kwargs.items() if value is not None}  # PEFT passes its Nones on
        if fused_lm_head and not args and shift_labels is None and labels is not None and _flattenable(given):
            return flat_pairs_forward(self, head, given["input_ids"], given["attention_mask"], labels,
                                      num_items_in_batch, example_boundaries)
        return padded_forward(*args, fused_lm_head=fused_lm_head, labels=labels, shift_labels=shift_labels,
                              num_items_in_batch=num_items_in_batch, **kwargs)

    model.forward = types.MethodType(forward, model)
    model._hf_tune_padded_forward = padded_forward


def uninstall_flat_pairs(model) -> None:
    """TRL's fused forward back on ``model``."""
    padded_forward = model.__dict__.pop("_hf_tune_padded_forward", None)
    if padded_forward is not None:
        model.forward = padded_forward


def _flattenable(given: dict) -> bool:
    """The call carries a padded text batch and nothing else this forward would drop (``False`` flags drop
    nothing: ``output_router_logits=False``, ``return_dict=True`` and the like)."""
    ids, mask = given.get("input_ids"), given.get("attention_mask")
    others = {name for name, value in given.items() if name not in _FLATTENED and value is not False}
    return (not others - {"return_dict"} and ids is not None and mask is not None and ids.dim() == 2
            and mask.shape == ids.shape)


def check_flat_pairs(model, head: LogitHead) -> None:
    """The flattened forward's log-probabilities on a tiny padded batch of two pairs (prompt tokens unscored, rows
    padded right) equal the model's own padded forward's, within the rounding of the head's dtype; ``RecipeError``
    naming ``training.padding_free`` where they do not."""
    weight = head.linear.weight
    device = model.get_input_embeddings().weight.device
    lengths = torch.tensor([9, 6, 7, 4], device=device)
    ids = (torch.arange(lengths.max(), device=device)[None] * 7919 + 31 * torch.arange(4, device=device)[:, None])
    ids = ids % weight.shape[0]
    attention_mask = (torch.arange(lengths.max(), device=device)[None] < lengths[:, None]).long()
    labels = ids.masked_fill(attention_mask == 0, IGNORE_INDEX)
    labels[:, :2] = IGNORE_INDEX  # the prompt
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=attention_mask, use_cache=False).logits.float()
            got = model(input_ids=ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True,
                        use_cache=False).log_probs
    finally:
        model.train(was_training)
    scored = labels[:, 1:] != IGNORE_INDEX
    expected = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, labels[:, 1:].clamp(min=0)[..., None])
    expected = expected.squeeze(-1).masked_fill(~scored, 0).to(got.device)
    unit_roundoff = torch.finfo(weight.dtype).eps / 2
    tolerance = 1e-4 if weight.dtype == torch.float32 else 8 * unit_roundoff * float(logits.abs().max()) + 1e-3
    difference = float((got - expected).abs().max())
    if not difference <= tolerance:
        raise RecipeError(KEY, f"{type(model).__name__}'s pairs as one flattened row do not give its padded "
                          f"log-probabilities (largest difference {difference:.3g}, tolerance {tolerance:.3g}): its "
                          "attention does not keep flattened sequences apart", fix="set training.padding_free: false")
