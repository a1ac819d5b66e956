"""Chat-template markers a base model's tokenizer lacks (ChatML's ``<|im_start|>`` on a base model): added as special
tokens, the embeddings resized, and their rows trained.

Without this, ``<|im_start|>`` is split into sub-words such as ``<``, ``|``, ``im``, ``_start``, ``|>``: every turn
then costs several tokens, and the model learns to spell its end-of-turn marker instead of emitting one token. With
a ``lora`` section the new rows train through PEFT's ``trainable_token_indices`` (only those rows, of the input
embeddings and, when untied, of the output head); a full fine-tune trains every row anyway.
"""

from __future__ import annotations

import logging
import re

logger = logging.getLogger(__name__)
# Marker shapes: <|im_start|>, <|eot_id|>, <start_of_turn>, <end_of_turn>; a closing tag (</s>) or plain text is not one
MARKER = re.compile(r"<\|[A-Za-z0-9_.\-]+\|>|<[A-Za-z][A-Za-z0-9]*(?:_[A-Za-z0-9]+)+>")
NEW_TOKENS = "hf_tune_new_tokens"  # attribute of the tokenizer: the markers build_tokenizer added


def template_markers(template: str) -> list[str]:
    """Marker-shaped literals of a chat template, in order of first appearance."""
    return list(dict.fromkeys(MARKER.findall(template)))


# Tool-call tags (Qwen's <tool_call>, <tool_response>) wrap text the model writes inside its turn, and TRL reads the
# calls back from the decoded text: left as text, a base spells them with tokens it already predicts. Added as new
# tokens, their rows start untrained: after 16 LoRA steps on 48 tool chats (recipes/llm_agent_sft.yaml, lr 1e-3),
# SmolLM2-135M ranked the new <tool_call> 2,332th where a call begins and wrote no parseable call.
TEXT_MARKER = re.compile(r"<tool_[A-Za-z0-9_]+>")


def add_template_tokens(tokenizer, template: str) -> list[str]:
    """Add the template's turn markers that the tokenizer splits into several tokens as special tokens (tool-call
    tags stay text: ``TEXT_MARKER``); returns them (also kept as ``tokenizer.hf_tune_new_tokens`` for
    ``build_model``)."""
    missing = [marker for marker in template_markers(template) if not TEXT_MARKER.fullmatch(marker)
               and len(tokenizer(marker, add_special_tokens=False)["input_ids"]) != 1]
    if missing:
        tokenizer.add_tokens(missing, special_tokens=True)
    setattr(tokenizer, NEW_TOKENS, missing)
    return missing


def new_token_ids(tokenizer) -> list[int]:
    return [tokenizer.convert_tokens_to_ids(token) for token in getattr(tokenizer, NEW_TOKENS, None) or []]


def fit_embeddings(model, tokenizer) -> int:
    """Resize the embeddings to the tokenizer when it has more tokens than rows (new rows: transformers' mean
    initialisation); returns the number of rows now."""
    rows = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > rows:
        model.resize_token_embeddings(len(tokenizer))
        rows = model.get_input_embeddings().num_embeddings
    return rows


def trainable_token_indices(model, ids: list[int]) -> dict[str, list[int]]:
    """PEFT's ``trainable_token_indices`` for these ids: the input embeddings, and the output head when untied."""
    def short_name(module) -> str:
        return next(name.rsplit(".", 1)[-1] for name, m in model.named_modules() if m is module)

    targets = {short_name(model.get_input_embeddings()): ids}
    head = model.get_output_embeddings()
    if head is not None and head.weight is not model.get_input_embeddings().weight:
        targets[short_name(head)] = ids
    return targets


def log_new_tokens(tokenizer, rows: int, how: str) -> None:
    tokens = getattr(tokenizer, NEW_TOKENS, None)
    if tokens:
        logger.info("data.chat_template: added %d special tokens the tokenizer lacked (%s); embeddings now %d rows; "
                    "their rows train %s", len(tokens), ", ".join(tokens), rows, how)
