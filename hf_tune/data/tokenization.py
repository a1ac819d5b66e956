"""Tokens and labels: assistant tokens (with each turn's end-of-turn token) are trained, everything else is -100."""

from __future__ import annotations

import bisect
import logging
from pathlib import Path
from typing import Any

from datasets import Dataset
from datasets.fingerprint import Hasher

from hf_tune.catalog.templates import fitting_templates
from hf_tune.data.formats import Conversation, check_columns, format_of
from hf_tune.data.messages import example_tools, load_tools, uses_tools
from hf_tune.data.rendering import assistant_char_spans, check_template_renders_tools, check_tools_rendered
from hf_tune.errors import RecipeError, stage_errors
from hf_tune.recipe.schema import DataSection

logger = logging.getLogger(__name__)
IGNORE_INDEX = -100  # the labels' ignored position (hf_tune.model.chunked_logprobs, where the loss reads it)
TOKENIZATION_VERSION = "3"  # bump when the token/label rules change: old caches are then never reused
# 2: a conversational prompt_completion trains its completion only, not the assistant turns inside its prompt
# 3: messages keep tool calls, tool results and reasoning; tools reach the template; history-rewriting templates


def tokenize_chat(tokenizer, messages: list[dict[str, Any]], prompt_turns: int = 0,
                  tools: list[dict] | None = None) -> tuple[list[int], list[int]]:
    """Tokens of the rendered conversation (``tools`` offered to the template) and their labels: the tokens that
    start inside an assistant span (hf_tune.data.rendering) keep their id, all others are -100."""
    text, spans = assistant_char_spans(tokenizer, messages, prompt_turns, tools)
    check_tools_rendered(text, messages, tools)
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


def tokenize_example(example: dict[str, Any], tokenizer, format: str, max_length: int,
                     tools: list[dict] | None = None) -> dict[str, list[int]]:
    """One example's tokens and labels; ``tools``: ``data.tools``, offered where the example has no ``tools`` column."""
    normalized = format_of(format).normalize(example)
    if isinstance(normalized, Conversation):
        input_ids, labels = tokenize_chat(tokenizer, *normalized, tools=example_tools(example, tools))
    else:
        input_ids, labels = tokenize_pair(tokenizer, *normalized)
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
                        load_tools(data.tools), TOKENIZATION_VERSION])


def _fitting(tokenizer) -> list[str]:
    """Named templates that fit the tokenizer's model, read off the config beside it where it is a local folder."""
    import json


    config = Path(getattr(tokenizer, "name_or_path", "") or ".") / "config.json"
    model_type = json.loads(config.read_text()).get("model_type") if config.is_file() else None
    names = fitting_templates(model_type)
    return names[:2] + ["chatml"] if len(names) > 3 else names


def tokenize_dataset(raw: Dataset, tokenizer, data: DataSection, key: str) -> Dataset:
    """Tokenize (cached under a fingerprint of data + tokenizer + template) and drop examples with nothing to train."""
    check_columns(data.format, raw.column_names, key)
    templated = format_of(data.format).chat_template
    if templated and not tokenizer.chat_template:
        raise RecipeError("data.chat_template", f"the tokenizer has no chat template and format '{data.format}' "
                          "needs one", fix=f"name one: data.chat_template: {' or '.join(_fitting(tokenizer))} "
                          "(or a .jinja file, or the template text)")
    tools = load_tools(data.tools)
    if templated and uses_tools(raw, tools):
        check_template_renders_tools(tokenizer)

    tokenize_batch = batch_tokenizer(tokenizer, data, tools)
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


def batch_tokenizer(tokenizer, data: DataSection, tools: list[dict] | None):
    """A batched ``map`` function: tokens and labels of each example, without those left with nothing to train."""
    def tokenize_batch(batch: dict[str, list]) -> dict[str, list]:
        out = {"input_ids": [], "attention_mask": [], "labels": []}
        for i in range(len(next(iter(batch.values())))):
            row = tokenize_example({k: v[i] for k, v in batch.items()}, tokenizer, data.format, data.max_length,
                                   tools)
            if any(label != IGNORE_INDEX for label in row["labels"]):
                for name, values in row.items():
                    out[name].append(values)
        return out

    return tokenize_batch


def sample_prompts(tokenizer, task) -> dict:
    """Three prompts, as a padded batch (in the chat template for a causal LM): the inputs of ``hf-tune merge
    --check`` for a text task (``Task.check_inputs``)."""
    texts = ["What is the capital of France?", "Write a haiku about the sea.", "2 + 2 ="]
    if task.causal and tokenizer.chat_template:
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                               add_generation_prompt=True) for t in texts]
    return tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=not task.causal)
