"""Tokens and labels: assistant tokens (with each turn's end-of-turn token) are trained, everything else is -100."""

from __future__ import annotations

import bisect
import logging
from typing import Any

from datasets import Dataset
from datasets.fingerprint import Hasher

from hf_tune.data.formats import check_columns, to_messages
from hf_tune.errors import RecipeError, stage_errors
from hf_tune.recipe.schema import DataSection

logger = logging.getLogger(__name__)
IGNORE_INDEX = -100
TOKENIZATION_VERSION = "2"  # bump when the token/label rules change: old caches are then never reused
# 2: a conversational prompt_completion trains its completion only, not the assistant turns inside its prompt


def assistant_char_spans(tokenizer, messages: list[dict[str, str]],
                         prompt_turns: int = 0) -> tuple[str, list[tuple[int, int]]]:
    """Render the conversation; return its text and the character spans of each assistant turn after the first
    ``prompt_turns`` messages (a prompt's own assistant turns are context, not trained).

    A span runs from where the assistant's content starts (the end of the prompt rendered with the generation
    prompt) to the end of that turn's rendering, trailing whitespace removed, so it ends on the end-of-turn token.
    """
    def render(msgs, generation_prompt=False):
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=generation_prompt)

    text = render(messages)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant" or i < prompt_turns:
            continue
        before, through = render(messages[:i], generation_prompt=True), render(messages[: i + 1])
        if not (text.startswith(before) and text.startswith(through) and len(through.rstrip()) > len(before)):
            raise RecipeError("data.chat_template", "the chat template does not render a conversation as the sum "
                              "of its turns (it rewrites earlier turns), so assistant tokens cannot be located",
                              fix="set data.chat_template to a template that renders each turn independently")
        spans.append((len(before), len(through.rstrip())))
    return text, spans


def tokenize_chat(tokenizer, messages: list[dict[str, str]], prompt_turns: int = 0) -> tuple[list[int], list[int]]:
    text, spans = assistant_char_spans(tokenizer, messages, prompt_turns)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    starts = [start for start, _ in spans]
    labels = []
    for token, (char_start, _) in zip(encoded["input_ids"], encoded["offset_mapping"]):
        i = bisect.bisect_right(starts, char_start) - 1
        labels.append(token if i >= 0 and char_start < spans[i][1] else IGNORE_INDEX)
    return encoded["input_ids"], labels


def tokenize_pair(tokenizer, prompt: str, completion: str) -> tuple[list[int], list[int]]:
    """Plain-text prompt/completion (or text alone when prompt is empty): the completion and eos are trained."""
    prompt_ids = tokenizer(prompt, add_special_tokens=True)["input_ids"] if prompt else []
    completion_ids = tokenizer(completion, add_special_tokens=not prompt)["input_ids"] + [tokenizer.eos_token_id]
    return prompt_ids + completion_ids, [IGNORE_INDEX] * len(prompt_ids) + completion_ids


def tokenize_example(example: dict[str, Any], tokenizer, format: str, max_length: int) -> dict[str, list[int]]:
    conversation = to_messages(example, format)
    if conversation is not None:
        input_ids, labels = tokenize_chat(tokenizer, *conversation)
    elif format == "text":
        input_ids, labels = tokenize_pair(tokenizer, "", example["text"])
    else:
        input_ids, labels = tokenize_pair(tokenizer, example["prompt"], example["completion"])
    input_ids, labels = input_ids[:max_length], labels[:max_length]
    return {"input_ids": input_ids, "attention_mask": [1] * len(input_ids), "labels": labels}


def tokenizer_fingerprint(tokenizer) -> str:
    """Changes whenever the tokenizer would produce other tokens: vocabulary, rules, special tokens, chat template."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    rules = backend.to_str() if backend is not None else sorted(tokenizer.get_vocab().items())
    return Hasher.hash([rules, tokenizer.chat_template, tokenizer.all_special_tokens, tokenizer.pad_token,
                        tokenizer.eos_token, tokenizer.padding_side, tokenizer.truncation_side])


def tokenized_fingerprint(raw: Dataset, tokenizer, data: DataSection) -> str:
    return Hasher.hash([raw._fingerprint, tokenizer_fingerprint(tokenizer), data.format, data.max_length,
                        TOKENIZATION_VERSION])


def tokenize_dataset(raw: Dataset, tokenizer, data: DataSection, key: str) -> Dataset:
    """Tokenize (cached under a fingerprint of data + tokenizer + template) and drop examples with nothing to train."""
    check_columns(data.format, raw.column_names, key)
    if to_messages_needed(data.format) and not tokenizer.chat_template:
        raise RecipeError("data.chat_template", f"the tokenizer has no chat template and format '{data.format}' "
                          "needs one", fix="set data.chat_template to a Jinja template (text or a .jinja file)")

    def tokenize_batch(batch: dict[str, list]) -> dict[str, list]:
        out = {"input_ids": [], "attention_mask": [], "labels": []}
        for i in range(len(next(iter(batch.values())))):
            row = tokenize_example({k: v[i] for k, v in batch.items()}, tokenizer, data.format, data.max_length)
            if any(label != IGNORE_INDEX for label in row["labels"]):
                for name, values in row.items():
                    out[name].append(values)
        return out

    with stage_errors(key, f"tokenizing (format {data.format!r})"):
        tokenized = raw.map(tokenize_batch, batched=True, remove_columns=raw.column_names, num_proc=data.num_proc,
                            new_fingerprint=tokenized_fingerprint(raw, tokenizer, data),
                            desc=f"Tokenizing {key} ({data.format})")
    dropped = len(raw) - len(tokenized)
    if dropped == len(raw):
        raise RecipeError(key, f"all {len(raw)} examples have no trainable token (empty answers, or cut off by "
                          f"max_length={data.max_length})", fix="raise data.max_length or check the data format")
    if dropped:
        logger.warning("%s: dropped %d of %d examples with no trainable token (empty answer or cut off by "
                       "data.max_length=%d)", key, dropped, len(raw), data.max_length)
    return tokenized


def to_messages_needed(format: str) -> bool:
    return format in ("chat", "instruction")
