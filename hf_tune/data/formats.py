"""Each data format as a conversation (a list of role/content messages) or a prompt/completion pair of plain text.

  chat               messages: [{role, content}, ...]  or ShareGPT conversations: [{from, value}, ...]
  instruction        instruction, input (optional), output, system (optional)      (alpaca)
  prompt_completion  prompt, completion: plain strings, or lists of messages; only the completion is trained
  text               text: trained on every token
  classification     text, text_pair (optional), label (a string or an integer)
"""

from __future__ import annotations

from typing import Any

from hf_tune.data.messages import chat_messages, normalize_message
from hf_tune.errors import RecipeError

FORMAT_COLUMNS = {
    "chat": ("messages", "conversations"),
    "instruction": ("instruction", "output"),
    "prompt_completion": ("prompt", "completion"),
    "text": ("text",),
    "classification": ("text", "label"),
}
FORMAT_HELP = {
    "chat": "a 'messages' list of {role, content} turns, or a ShareGPT 'conversations' list of {from, value} turns",
    "instruction": "'instruction' and 'output' strings, optional 'input' and 'system' strings",
    "prompt_completion": "'prompt' and 'completion': strings, or lists of {role, content} messages",
    "text": "a 'text' string",
    "classification": "a 'text' string (optional 'text_pair'), and a 'label': a class name or an integer id",
}


def check_columns(format: str, columns: list[str], key: str, where: str | None = None) -> None:
    """The columns ``format`` reads are there; ``where`` (the file) is named in the error when given."""
    wanted, source = FORMAT_COLUMNS[format], f"{where} has" if where else "the data has"
    if format == "chat":
        if not any(c in columns for c in wanted):
            raise RecipeError(key, f"format 'chat' needs a 'messages' (role/content) or 'conversations' (from/value) "
                              f"column; {source} {columns}", fix="set data.format to match the data")
        return
    missing = [c for c in wanted if c not in columns]
    if missing:
        raise RecipeError(key, f"format '{format}' needs columns {list(wanted)}; missing {missing}, {source} "
                          f"{columns}", fix="rename the columns or set data.format to match the data")


def to_messages(example: dict[str, Any], format: str) -> tuple[list[dict[str, Any]], int] | None:
    """The example as a conversation, with the number of its leading messages that are prompt only (their assistant
    turns are not trained: a conversational prompt_completion's prompt); None when it is plain text (``text``, or
    string prompt/completion)."""
    if format == "chat":  # messages keep tool calls, tool results and reasoning (hf_tune.data.messages)
        return chat_messages(example), 0
    if format == "instruction":
        prompt = example["instruction"]
        if example.get("input"):
            prompt = f"{prompt}\n\n{example['input']}"
        messages = [{"role": "system", "content": example["system"]}] if example.get("system") else []
        return [*messages, {"role": "user", "content": prompt}, {"role": "assistant", "content": example["output"]}], 0
    if format == "prompt_completion" and isinstance(example["prompt"], list):
        prompt = [normalize_message(m) for m in example["prompt"]]
        completion = example["completion"]
        completion = [normalize_message(m) for m in completion] if isinstance(
            completion, list) else [{"role": "assistant", "content": completion}]
        return [*prompt, *completion], len(prompt)
    return None
