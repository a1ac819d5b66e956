"""Data of the TRL methods, in TRL's standard layouts, checked row by row before any trainer tokenizes it.

  preference           prompt, chosen, rejected: strings, or lists of {role, content} messages
                       chosen, rejected only: whole conversations sharing a prompt (the implicit-prompt form)
                       LLaMA-Factory: ShareGPT `conversations` (+ `system`) with `chosen` / `rejected` messages
                       ({from, value}), or `instruction` (+ `input`) with `chosen` / `rejected` strings
  unpaired_preference  prompt, completion, label (true: desirable)       (KTO; a preference set is unpaired for it)
                       LLaMA-Factory: `messages` ending in the assistant's answer (the completion), and `label`
  prompt_only          prompt: a string or messages; other columns (an `answer`) go to the reward functions (GRPO)

Each layout becomes TRL's own (conversational where the data is), so TRL's trainers apply the chat template.
"""

from __future__ import annotations

from typing import Any

from datasets import Dataset

from hf_tune.catalog.methods import method_of
from hf_tune.catalog.rewards import check_reward_columns
from hf_tune.data.formats import check_columns, format_of, row_refusal
from hf_tune.data.loading import describe_source, line_of_row, load_source, local_files
from hf_tune.data.messages import SHAREGPT_ROLES, content_problem, part_value
from hf_tune.recipe.schema import DataSection, DatasetSource


def load_method_data(data: DataSection, method: str, seed: int, rewards: list | None = None
                     ) -> tuple[Dataset, Dataset | None]:
    """Train and eval examples of a TRL method in TRL's layout; ``eval_split`` holds out a seeded fraction.
    ``rewards``: GRPO's reward entries, whose columns each file must have."""
    train = _load(data.train, "data.train", data.format, method, rewards or [])
    if data.eval is not None:
        return train, _load(data.eval, "data.eval", data.format, method, rewards or [])
    if data.eval_split:
        parts = train.train_test_split(test_size=data.eval_split, seed=seed)
        return parts["train"], parts["test"]
    return train, None


def _load(source: DatasetSource, key: str, format: str, method: str, rewards: list) -> Dataset:
    dataset = load_source(source, key)
    files = local_files(source)
    where = describe_source(source)
    line_of = (lambda row: line_of_row(files[0], row)) if len(files) == 1 and files[0].suffix == ".jsonl" else None
    refuse, spec = row_refusal(format, key, where, len(dataset), line_of), format_of(format)
    check_columns(format, dataset.column_names, key, where)
    check_reward_columns(rewards, dataset.column_names, f"{key} ({where})")
    normalize = spec.normalize
    for row, example in enumerate(dataset):  # every row checked first, so the error names the first bad one
        try:
            normalize(example)
        except BadRow as bad:
            refuse(row, bad.column, bad.problem)
    # map keeps the data file-backed under a fingerprint every process computes alike, so TRL's tokenization and
    # reference pass share their cache files across the ranks of a distributed launch
    read = [c for c in spec.column_names if c in dataset.column_names]
    normalized = dataset.map(_normalized, fn_kwargs={"format": format}, remove_columns=read,
                             desc=f"reading {key} ({format})")
    normalized = normalized.rename_columns({c: c.removeprefix(_NEW) for c in normalized.column_names
                                            if c.startswith(_NEW)})
    if spec.name in method_of(method).unpaired_formats:
        from trl.data_utils import unpair_preference_dataset

        normalized = unpair_preference_dataset(normalized)
    return normalized


_NEW = "hf_tune_normalized_"  # map keeps an input column's features for an output of its name (a Json-typed
# content column, from typed parts beside strings, would re-encode the joined strings): outputs take new names


def _normalized(example: dict[str, Any], format: str) -> dict[str, Any]:
    return {_NEW + k: v for k, v in format_of(format).normalize(example).items()}


class BadRow(Exception):
    """A row its format cannot read: the column and what is wrong with it."""

    def __init__(self, column: str, problem: str):
        super().__init__(problem)
        self.column, self.problem = column, problem


def preference_row(example: dict[str, Any]) -> dict[str, Any]:
    """A preference example in TRL's layout: prompt, chosen, rejected (conversational where the data is)."""
    chosen, rejected = example["chosen"], example["rejected"]
    if example.get("conversations") is not None:  # LLaMA-Factory (ShareGPT)
        prompt = _sharegpt(example["conversations"], "conversations")
        if example.get("system"):
            prompt = [{"role": "system", "content": example["system"]}, *prompt]
        chosen, rejected = _one_reply(chosen, "chosen"), _one_reply(rejected, "rejected")
    elif example.get("instruction") is not None:  # LLaMA-Factory (alpaca)
        text = example["instruction"] + (f"\n\n{example['input']}" if example.get("input") else "")
        prompt = [{"role": "user", "content": text}]
        chosen, rejected = _one_reply(chosen, "chosen"), _one_reply(rejected, "rejected")
    else:
        prompt = example.get("prompt")
        prompt = None if prompt is None else _text_or_messages(prompt, "prompt")
        chosen, rejected = _text_or_messages(chosen, "chosen"), _text_or_messages(rejected, "rejected")
    if prompt is None:  # implicit prompt: whole conversations with a shared beginning
        if not (isinstance(chosen, list) and isinstance(rejected, list)):
            raise BadRow("prompt", "is missing: without a prompt, 'chosen' and 'rejected' must be whole conversations")
        shared = _shared_prefix(chosen, rejected)
        if shared == 0:
            raise BadRow("chosen", "'chosen' and 'rejected' share no prompt: their first messages differ")
        prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
    elif isinstance(prompt, list) != isinstance(chosen, list) and isinstance(chosen, str):
        chosen, rejected = _as_reply(chosen), _as_reply(rejected)  # a conversational prompt, string answers
    for column, answer in (("chosen", chosen), ("rejected", rejected)):
        if not _text(answer).strip():
            raise BadRow(column, "the answer is empty")
    if _text(chosen).strip() == _text(rejected).strip():
        raise BadRow("rejected", "equals 'chosen': a pair must prefer one answer over a different one")
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected}


def unpaired_row(example: dict[str, Any]) -> dict[str, Any]:
    """An unpaired preference example in TRL's layout: prompt, completion, label."""
    if example.get("prompt") is None and "messages" in example:  # LLaMA-Factory: the last turn is the completion
        prompt, completion = _split_last_answer(example["messages"])
    else:
        prompt = _text_or_messages(example["prompt"], "prompt")
        completion = _text_or_messages(example["completion"], "completion")
    if isinstance(prompt, list) and isinstance(completion, str):
        completion = _as_reply(completion)
    if not _text(completion).strip():
        raise BadRow("completion", "the completion is empty")
    if not isinstance(example["label"], bool):
        raise BadRow("label", f"expected true (desirable) or false, got {example['label']!r}")
    return {"prompt": prompt, "completion": completion, "label": example["label"]}


def _split_last_answer(value: Any) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """(prompt, completion) of a conversation ending in the assistant's answer."""
    messages = _text_or_messages(value, "messages")
    if not isinstance(messages, list) or len(messages) < 2:
        raise BadRow("messages", "expected a conversation of at least two messages: the prompt, then the "
                                  "assistant's answer")
    if messages[-1]["role"] != "assistant":
        raise BadRow("messages", f"the last message has role {messages[-1]['role']!r}: the last message is the "
                                  "completion, so it must be the assistant's answer")
    return messages[:-1], messages[-1:]


def prompt_row(example: dict[str, Any]) -> dict[str, Any]:
    """A prompt-only example in TRL's layout: the prompt (the other columns stay for the rewards)."""
    prompt = _text_or_messages(example["prompt"], "prompt")
    if not _text(prompt, roles=None).strip():
        raise BadRow("prompt", "the prompt is empty")
    return {"prompt": prompt}


def _text_or_messages(value: Any, column: str) -> str | list[dict[str, str]]:
    if value is None:
        raise BadRow(column, "is missing (null)")
    if isinstance(value, str):
        return value
    if isinstance(value, dict):  # one message
        value = [value]
    if not isinstance(value, list) or not value:
        raise BadRow(column, f"expected a string or a non-empty list of {{role, content}} messages, got {value!r:.60}")
    messages = []
    for number, message in enumerate(value, 1):
        if not isinstance(message, dict):
            raise BadRow(column, f"message {number}: expected {{role, content}}, got {message!r:.60}")
        if "from" in message:
            messages.extend(_sharegpt([message], column))
            continue
        content = message.get("content")
        if isinstance(content, list):  # typed parts (OpenAI's text, LLaMA-Factory's text value): joined
            content = _text_parts(content, column, number)
        if not isinstance(message.get("role"), str) or not isinstance(content, str):
            raise BadRow(column, f"message {number} has keys {sorted(message)}, expected 'role' and 'content' strings")
        messages.append({"role": message["role"], "content": content})
    return messages


def _text_parts(parts: list, column: str, number: int) -> str:
    """A message's text parts joined (``hf_tune.data.messages``: as chat data reads them); TRL's trainers render the
    pairs themselves, so reasoning and tool-call parts are refused here by name."""
    problem = content_problem(parts, "assistant")
    if problem is None and any(part["type"] != "text" for part in parts):
        kind = next(part["type"] for part in parts if part["type"] != "text")
        problem = f"a {kind} part: {column} messages take text parts only"
    if problem:
        raise BadRow(column, f"message {number}: {problem}")
    return "".join(part_value(part) for part in parts)


def _sharegpt(turns: Any, column: str) -> list[dict[str, str]]:
    if not isinstance(turns, list):
        raise BadRow(column, f"expected a list of {{from, value}} turns, got {turns!r:.60}")
    messages = []
    for number, turn in enumerate(turns, 1):
        if not isinstance(turn, dict) or turn.get("from") not in SHAREGPT_ROLES or not isinstance(
                turn.get("value"), str):
            raise BadRow(column, f"turn {number}: expected {{from: one of {sorted(SHAREGPT_ROLES)}, value: a "
                                  f"string}}, got {turn!r:.80}")
        messages.append({"role": SHAREGPT_ROLES[turn["from"]], "content": turn["value"]})
    return messages


def _one_reply(value: Any, column: str) -> list[dict[str, str]]:
    if isinstance(value, str):
        return _as_reply(value)
    messages = _text_or_messages(value, column)
    return [dict(m, role="assistant") for m in messages] if isinstance(messages, list) else _as_reply(messages)


def _as_reply(text: str) -> list[dict[str, str]]:
    return [{"role": "assistant", "content": text}]


def _text(value: str | list[dict[str, str]], roles: tuple[str, ...] | None = ("assistant",)) -> str:
    """The text of an answer (its assistant messages), or of every message with ``roles=None``."""
    if isinstance(value, str):
        return value
    return "".join(m["content"] for m in value if roles is None or m["role"] in roles)


def _shared_prefix(a: list[dict[str, str]], b: list[dict[str, str]]) -> int:
    """Messages that both conversations begin with, ending before the first assistant message that differs."""
    shared = 0
    while shared < min(len(a), len(b)) - 1 and a[shared] == b[shared]:
        shared += 1
    return shared

