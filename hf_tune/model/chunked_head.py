"""The LM head the chunked loss reads (``model.chunked_loss``), found through public accessors and proven on the
model itself before training: its logits on a few tokens must equal the head applied to its last hidden state,
taken from a forward that asks for hidden states and one position's logits a row, the one training then runs."""

from __future__ import annotations

import inspect
import logging

import torch

from hf_tune.errors import RecipeError
from hf_tune.model.chunked_logprobs import LogitHead
from hf_tune.recipe.quantization import weight_sharding
from hf_tune.recipe.schema import Recipe

logger = logging.getLogger(__name__)

KEY = "model.chunked_loss"
PROBE_TOKENS = 8


def default_chunked_loss_head(recipe: Recipe, model) -> LogitHead | None:
    """``model.chunked_loss`` left unset: the head where the chunked loss is proven on the model and costs no time
    (a frozen head, as under LoRA: its backward recomputes no logits), else None, with a log line saying why."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    reason = recipe_turns_chunked_loss_off(recipe)
    if reason is None and head is not None and getattr(head, "weight", None) is not None and head.weight.requires_grad:
        reason = "the LM head trains, and its chunked backward would recompute the logits (slower)"
    if reason is None:
        try:
            return chunked_loss_head(model)
        except RecipeError as err:
            reason = err.problem
    logger.info("%s: off, the loss reads the full logits of the trained positions (%s)", KEY, reason)
    return None


def recipe_turns_chunked_loss_off(recipe: Recipe) -> str | None:
    """Why the recipe alone keeps the default chunked loss off (the full logits of the trained positions), or None."""
    if recipe.model.logits_to_keep != "trained":
        return "model.logits_to_keep is 'all'"
    sharded = weight_sharding(recipe)
    return None if sharded is None else f"{sharded[0]} shards the LM head over ranks"


def expects_chunked_loss(recipe: Recipe) -> bool:
    """Whether an SFT run of ``recipe`` computes the chunked loss, decided without the model (``decide``): the key's
    value, else on under LoRA that leaves the LM head frozen. The run proves the head on the model and falls back
    where that fails."""
    if recipe.model.chunked_loss is not None:
        return recipe.model.chunked_loss
    return why_no_chunked_loss(recipe) is None


def why_no_chunked_loss(recipe: Recipe) -> str | None:
    """Why the default keeps the chunked loss off for this recipe (the full logits of the trained positions), or
    None where it is on."""
    lora = recipe.lora or {}
    if recipe.lora is None or "lm_head" in f"{lora.get('target_modules')} {lora.get('modules_to_save')}":
        return "the LM head trains, and its chunked backward would recompute the logits (slower)"
    return recipe_turns_chunked_loss_off(recipe)


def log_chunked_loss_off(recipe: Recipe) -> None:
    """The default's decision to keep the chunked loss off, and why: one log line."""
    logger.info("%s: off, the loss reads the full logits of the trained positions (%s)", KEY,
                why_no_chunked_loss(recipe))


def chunked_loss_head(model) -> LogitHead:
    """The model's LM head as a ``LogitHead``, with the scale and softcap its config applies; ``RecipeError`` naming
    ``model.chunked_loss`` where there is no plain Linear head, no ``logits_to_keep``, or the probe disagrees."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT's public accessor
    name = type(base).__name__
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if type(head) is not torch.nn.Linear:
        found = "not found (get_output_embeddings() gives None)" if head is None else f"a {type(head).__name__}"
        raise RecipeError(KEY, f"{name}'s output head is {found}, not a plain torch.nn.Linear the chunked loss can "
                          "read (LoRA or quantization on the head, or a model without one)",
                          fix="remove model.chunked_loss, or keep lm_head out of lora.target_modules")
    if "logits_to_keep" not in inspect.signature(type(base).forward).parameters:
        raise RecipeError(KEY, f"{name}.forward takes no logits_to_keep, so it would compute the full logits anyway",
                          fix="remove model.chunked_loss")
    config = base.config.get_text_config()
    scaling = getattr(config, "logits_scaling", None)  # Granite divides the logits by it
    logit_head = LogitHead(head, logit_scale=float(getattr(config, "logit_scale", None) or 1.0) / float(scaling or 1.0),
                           softcap=getattr(config, "final_logit_softcapping", None))  # Cohere, Gemma 2/3
    check_head_reproduces_logits(model, logit_head)
    return logit_head


def hidden_state_inputs(inputs: dict) -> dict:
    """A training batch's model inputs asking for the hidden states and the logits of one position a row
    (``logits_to_keep=1``: a [rows, 1, vocabulary] product). Not an all-False mask: Liger's patched forward
    (``training.use_liger_kernel``) slices ``hidden_states[:, logits_to_keep, :]`` and takes no 2-D mask."""
    return {**inputs, "logits_to_keep": 1, "output_hidden_states": True}


def check_head_reproduces_logits(model, head: LogitHead) -> None:
    """The model's own log-probabilities of a few tokens equal ``head`` applied to the last hidden state of a
    one-position-logits forward, within the rounding of the head's dtype: the proof that the chunked loss is the
    model's."""
    weight = head.linear.weight
    device = model.get_input_embeddings().weight.device
    ids = (torch.arange(PROBE_TOKENS, device=device) * 7919 % weight.shape[0])[None]
    targets = ids.roll(-1, dims=1)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logits = model(input_ids=ids, use_cache=False).logits.float()
            outputs = model(**hidden_state_inputs({"input_ids": ids, "use_cache": False}))
            got = head.target_logprobs(outputs.hidden_states[-1].to(weight.device), targets.to(weight.device))
    finally:
        model.train(was_training)
    expected = torch.log_softmax(logits, dim=-1).gather(-1, targets[..., None]).squeeze(-1).to(got.device)
    unit_roundoff = torch.finfo(weight.dtype).eps / 2
    tolerance = 1e-4 if weight.dtype == torch.float32 else 8 * unit_roundoff * float(logits.abs().max()) + 1e-3
    difference = float((got - expected).abs().max())
    if outputs.logits.shape[-2] != 1:
        raise RecipeError(KEY, f"{type(model).__name__}'s forward returned logits of {outputs.logits.shape[-2]} "
                          "positions when asked for one (logits_to_keep=1): it would compute every position's logits "
                          "anyway", fix="remove model.chunked_loss")
    if not difference <= tolerance:
        raise RecipeError(KEY, f"{type(model).__name__}'s logits are not its LM head applied to its last hidden state "
                          f"(largest log-probability difference {difference:.3g} on {PROBE_TOKENS} tokens, tolerance "
                          f"{tolerance:.3g}): its forward does more than the chunked loss knows (lm_head, logit_scale, "
                          "logits_scaling, final_logit_softcapping)", fix="remove model.chunked_loss")
