"""The data formats' code: their columns checked, bad rows reported, and the sft formats' normalisers. The table of
formats (names, columns, help, which normaliser) is ``hf_tune.catalog.formats``, re-exported here; the TRL methods'
normalisers are in ``hf_tune.data.preference``.

An sft example becomes a conversation (a list of role/content messages, rendered by the chat template) or plain text
(an untrained prompt and a trained completion).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, NoReturn

from hf_tune.catalog.formats import DEFAULT_FORMAT, FORMATS, Column, Format, format_of
from hf_tune.data.messages import chat_messages, normalize_message
from hf_tune.errors import RecipeError

__all__ = ["DEFAULT_FORMAT", "FORMATS", "Column", "Conversation", "Format", "PlainText", "check_columns",
           "format_of", "row_refusal"]


class Conversation(NamedTuple):
    """Messages rendered by the chat template; the first ``prompt_turns`` are prompt only (their assistant turns
    are not trained: a conversational prompt_completion's prompt)."""

    messages: list[dict[str, Any]]
    prompt_turns: int = 0


class PlainText(NamedTuple):
    """Plain text: the prompt is not trained (empty: none), the completion and eos are."""

    prompt: str
    completion: str


def check_columns(format: str, columns: list[str], key: str, where: str | None = None) -> None:
    """The columns ``format`` reads are there; ``where`` (the file) is named in the error when given."""
    spec, source = format_of(format), f"{where} has" if where else "the data has"
    layout = spec.layout(columns)
    missing = [c for c in layout if c not in columns]
    if not missing:
        return
    if len(spec.layouts) > 1 and all(len(one) == 1 for one in spec.layouts):  # messages or conversations
        needs = f"a {' or '.join(repr(one[0]) for one in spec.layouts)} column; {source} {columns}"
    else:
        needs = f"columns {list(layout)}; missing {missing}, {source} {columns}"
    raise RecipeError(key, f"format '{format}' needs {needs}", fix=f"set data.format to match the data, or rename "
                      f"the columns: data.format '{format}' reads {spec.help}")


def row_refusal(format: str, key: str, where: str, count: int,
                line_of: Callable[[int], int | None] | None = None) -> Callable[[int, str, str], NoReturn]:
    """``refuse(row, column, problem)``: raise the RecipeError that names ``key``, ``where`` (the file), the example
    (and its line, where ``line_of`` maps a row to one), the column, the problem and what the format reads."""
    def refuse(row: int, column: str, problem: str) -> NoReturn:
        line = line_of(row) if line_of else None
        place = f"line {line} (example {row + 1} of {count})" if line else f"example {row + 1} of {count}"
        raise RecipeError(key, f"{where}, {place}, column {column!r}: {problem}",
                          fix=f"make every example fit data.format '{format}' ({format_of(format).help}), or set "
                              "data.format to the data's format")

    return refuse


def chat_example(example: dict[str, Any]) -> Conversation:
    """messages kept whole (tool calls, tool results, reasoning: hf_tune.data.messages), or ShareGPT turns."""
    return Conversation(chat_messages(example))


def instruction_example(example: dict[str, Any]) -> Conversation:
    """alpaca: the instruction (and input) asked by the user, the output answered; an optional system turn first."""
    prompt = example["instruction"]
    if example.get("input"):
        prompt = f"{prompt}\n\n{example['input']}"
    messages = [{"role": "system", "content": example["system"]}] if example.get("system") else []
    return Conversation([*messages, {"role": "user", "content": prompt},
                         {"role": "assistant", "content": example["output"]}])


def prompt_completion_example(example: dict[str, Any]) -> Conversation | PlainText:
    """Plain text when the prompt is a string; else the prompt's messages (untrained) then the completion's."""
    if not isinstance(example["prompt"], list):
        return PlainText(example["prompt"], example["completion"])
    prompt = [normalize_message(m) for m in example["prompt"]]
    completion = example["completion"]
    completion = [normalize_message(m) for m in completion] if isinstance(
        completion, list) else [{"role": "assistant", "content": completion}]
    return Conversation([*prompt, *completion], len(prompt))


def text_example(example: dict[str, Any]) -> PlainText:
    """Every token trained."""
    return PlainText("", example["text"])
