"""Each data format as a conversation (a list of role/content messages) or a prompt/completion pair of plain text.

  chat               messages: [{role, content}, ...]  or ShareGPT conversations: [{from, value}, ...]
  instruction        instruction, input (optional), output, system (optional)      (alpaca)
  prompt_completion  prompt, completion: plain strings, or lists of messages
  text               text: trained on every token
  classification     text, text_pair (optional), label (a string or an integer)
"""

from __future__ import annotations

from typing import Any

from hf_tune.errors import HfTuneError

FORMAT_COLUMNS = {
    "chat": ("messages", "conversations"),
    "instruction": ("instruction", "output"),
    "prompt_completion": ("prompt", "completion"),
    "text": ("text",),
    "classification": ("text", "label"),
}
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
                  "tool": "tool", "function_call": "assistant", "observation": "tool"}


def check_columns(format: str, columns: list[str], key: str) -> None:
    wanted = FORMAT_COLUMNS[format]
    if format == "chat":
        if not any(c in columns for c in wanted):
            raise HfTuneError(f"{key}: format 'chat' needs a 'messages' (role/content) or 'conversations' (from/value) "
                              f"column; the data has {columns}\n  fix: set data.format to match the data")
        return
    missing = [c for c in wanted if c not in columns]
    if missing:
        raise HfTuneError(f"{key}: format '{format}' needs columns {list(wanted)}; missing {missing}, the data has "
                          f"{columns}\n  fix: rename the columns or set data.format to match the data")


def to_messages(example: dict[str, Any], format: str) -> list[dict[str, str]] | None:
    """The example as a conversation, or None when it is plain text (``text``, or string prompt/completion)."""
    if format == "chat":
        if example.get("messages") is not None:
            return [{"role": m["role"], "content": m["content"]} for m in example["messages"]]
        return [{"role": SHAREGPT_ROLES[t["from"]], "content": t["value"]} for t in example["conversations"]]
    if format == "instruction":
        prompt = example["instruction"]
        if example.get("input"):
            prompt = f"{prompt}\n\n{example['input']}"
        messages = [{"role": "system", "content": example["system"]}] if example.get("system") else []
        return [*messages, {"role": "user", "content": prompt}, {"role": "assistant", "content": example["output"]}]
    if format == "prompt_completion" and isinstance(example["prompt"], list):
        completion = example["completion"]
        completion = completion if isinstance(completion, list) else [{"role": "assistant", "content": completion}]
        return [*example["prompt"], *completion]
    return None
