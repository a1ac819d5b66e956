"""Conversations as chat templates expect them: OpenAI-style messages kept whole (tool calls, tool results, names,
reasoning), ShareGPT turns converted (LLaMA-Factory's ``function_call`` / ``observation`` become an assistant
``tool_calls`` turn and a ``tool`` turn), and the tool schemas an example offers.

A message's ``content`` may be a list of typed parts: OpenAI's and transformers' ``{"type": "text", "text": ...}``,
or LLaMA-Factory's ``{"type": "text" | "reasoning" | "tool_call", "value": ...}``. Text parts are joined into the
string content the templates render (most test ``content is string``); reasoning parts become the message's
``reasoning_content``, which reasoning templates (Qwen3's, DeepSeek-R1's) render in their think block; a tool-call
part (``{name, arguments}``, or its JSON) becomes one of the message's ``tool_calls``. Any other part type is refused
by name (images are read by ``data.format: vision_chat``). Calls without an id get ``call00000``, ``call00001``...
and the tool results after them, in order, get their ids and names.

Arrow stores a list of objects with one struct type for all rows, so keys missing from a message or a JSON schema
come back as null; nulls are removed before the template sees them (a template tests ``x is defined``, not
``x is none``). Tool-call arguments and tool lists written as JSON strings are parsed, as templates render
``arguments | tojson`` and loop over ``tools``.
"""

from __future__ import annotations

import json
from typing import Any

from hf_tune.errors import RecipeError

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
                  "tool": "tool", "function_call": "assistant", "observation": "tool"}
TOOLS_COLUMN = "tools"
PART_TYPES = ("text", "reasoning", "tool_call")  # the content parts chat reads


def without_nulls(value: Any) -> Any:
    """``value`` with every null-valued key of every object removed, recursively (Arrow's filler for absent keys)."""
    if isinstance(value, dict):
        return {k: without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [without_nulls(v) for v in value]
    return value


def chat_messages(example: dict[str, Any], read_parts: bool = True) -> list[dict[str, Any]]:
    """The conversation of a ``chat`` example: its ``messages`` kept whole (null keys removed, typed content parts
    read, tool-call arguments parsed), or its ShareGPT ``conversations`` converted; a ``system`` column opens it
    when it has no system turn. ``read_parts=False`` keeps content parts as they are (vision_chat reads images)."""
    if example.get("messages") is not None:
        messages = link_tool_calls([normalize_message(m, read_parts) for m in example["messages"]])
    else:
        messages = sharegpt_messages(example["conversations"])
    system = example.get("system")
    if isinstance(system, str) and system and not (messages and messages[0]["role"] == "system"):
        messages.insert(0, {"role": "system", "content": system})
    return messages


def normalize_message(message: dict[str, Any], read_parts: bool = True) -> dict[str, Any]:
    message = without_nulls(message)
    if read_parts and isinstance(message.get("content"), list):
        message = message_from_parts(message)
    if message.get("tool_calls"):
        message["tool_calls"] = [normalize_tool_call(call) for call in message["tool_calls"]]
    return message


def part_value(part: dict[str, Any]) -> Any:
    """A part's payload: OpenAI's and transformers' ``text``, or LLaMA-Factory's ``value``."""
    return part["text"] if part.get("text") is not None else part.get("value")


def message_from_parts(message: dict[str, Any]) -> dict[str, Any]:
    """A message whose content is typed parts, as templates render it: text parts joined as the content, reasoning
    parts as ``reasoning_content``, tool-call parts appended to ``tool_calls`` (checked: ``content_problem``)."""
    parts = message["content"]
    out = {**message, "content": "".join(part_value(p) for p in parts if p["type"] == "text")}
    reasoning = "".join(part_value(p) for p in parts if p["type"] == "reasoning")
    if reasoning:
        out["reasoning_content"] = message.get("reasoning_content", "") + reasoning
    calls = [part_value(p) for p in parts if p["type"] == "tool_call"]
    if calls:
        out["tool_calls"] = [*message.get("tool_calls", []), *(
            _parse_json(call, "a tool_call part") if isinstance(call, str) else call for call in calls)]
    return out


def content_problem(content: list, role: Any) -> str | None:
    """What keeps a list of content parts from being read (None when it fits): each part an object whose ``type``
    chat reads, text and reasoning as strings, tool calls (assistant turns only) as objects or their JSON."""
    for number, part in enumerate(content, 1):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            return f"content part {number}: expected an object with a 'type', got {_describe(part)}"
        kind = part["type"]
        if kind not in PART_TYPES:
            images = " (images are read by data.format: vision_chat)" if kind in ("image", "image_url") else ""
            return (f"content part {number} has type {kind!r}, which chat does not read: expected one of "
                    f"{', '.join(map(repr, PART_TYPES))}{images}")
        value = part_value(part)
        if kind == "tool_call" and not isinstance(value, (str, dict)):
            return (f"content part {number} (tool_call): expected {{name, arguments}} or its JSON, got "
                    f"{_describe(value)}")
        if kind != "tool_call" and not isinstance(value, str):
            keys = sorted(k for k, v in part.items() if v is not None)
            return (f"content part {number} ({kind}) has keys {keys}: its text goes in 'text' (OpenAI) or 'value' "
                    "(LLaMA-Factory)")
        if kind in ("reasoning", "tool_call") and role != "assistant":
            return (f"content part {number} is a {kind} part in a {role!r} turn: only assistant turns reason or call "
                    "tools")
    return None


def _describe(value: Any) -> str:
    names = {str: "a string", list: "a list", dict: "an object", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def link_tool_calls(messages: list[dict[str, Any]], start: int = 0) -> list[dict[str, Any]]:
    """Gives each tool call without an id the next ``callNNNNN`` (from ``start``; nine characters, as Mistral's
    templates ask), and each tool result without a ``tool_call_id`` the id and name of the first call before it
    not yet answered, so that a template reading ``tool_call_id`` finds them. Calls and results that have ids
    keep them."""
    pending: list[dict[str, Any]] = []  # calls not yet answered by a tool result
    count = start
    for message in messages:
        if message.get("tool_calls"):
            for call in message["tool_calls"]:
                if "id" not in call:
                    call["id"] = f"call{count:05d}"
                    count += 1
            pending = list(message["tool_calls"])
        elif message.get("role") == "tool" and pending:
            call = pending.pop(0)
            if "tool_call_id" not in message:
                message.update(tool_call_id=call["id"], name=message.get("name", call["function"]["name"]))
    return messages


def normalize_tool_call(call: dict[str, Any]) -> dict[str, Any]:
    """``{type: function, function: {name, arguments: {...}}}`` (with ``id`` when given), from that shape or a bare
    ``{name, arguments}``; arguments written as a JSON string are parsed."""
    function = call.get("function", call)
    arguments = function.get("arguments", function.get("parameters", {}))
    if isinstance(arguments, str):
        arguments = _parse_json(arguments, f"the arguments of tool call {function.get('name')!r}")
    out = {"type": "function", "function": {"name": function.get("name"), "arguments": arguments}}
    if call.get("id") is not None:
        out["id"] = call["id"]
    return out


def sharegpt_messages(turns: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """ShareGPT turns as messages. A ``function_call`` turn (its value: one ``{name, arguments}`` JSON object or a list
    of them) is an assistant turn with ``tool_calls``; an ``observation`` is a ``tool`` turn, answering the calls
    before it in order (``link_tool_calls`` gives them their ids)."""
    messages: list[dict[str, Any]] = []
    for turn in turns:
        kind, value = turn["from"], turn["value"]
        if kind == "function_call":
            parsed = _parse_json(value, "a function_call turn")
            calls = [normalize_tool_call(call) for call in (parsed if isinstance(parsed, list) else [parsed])]
            messages.append({"role": "assistant", "content": "", "tool_calls": calls})
        elif kind == "observation":
            messages.append({"role": "tool", "content": value})
        else:
            messages.append({"role": SHAREGPT_ROLES[kind], "content": value})
    return link_tool_calls(messages)


def example_tools(example: dict[str, Any], default: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """The tool schemas offered in this example: its ``tools`` column (a list, or a JSON string as LLaMA-Factory writes
    it), else ``data.tools``; bare ``{name, description, parameters}`` schemas are wrapped as
    ``{type: function, function: ...}``, the shape transformers' chat templates document. None when there are none.
    Null-valued keys are dropped from a list column (Arrow's filler for a key another row has) and kept from a JSON
    string, which renders as written (LLaMA-Factory's ``"required": null``)."""
    tools = example.get(TOOLS_COLUMN)
    written = isinstance(tools, str)  # JSON text has no filler for absent keys: its nulls are the data's own
    if written:
        tools = _parse_json(tools, "the 'tools' column") if tools.strip() else None
    if not tools:
        tools, written = default, False
    if not tools:
        return None
    return [wrap_tool(tool if written else without_nulls(tool)) for tool in tools]


def wrap_tool(tool: dict[str, Any]) -> dict[str, Any]:
    return tool if "function" in tool else {"type": "function", "function": tool}


def tool_names(tools: list[dict[str, Any]] | None) -> list[str]:
    return [t["function"].get("name", "") for t in tools or []]


def called_names(messages: list[dict[str, Any]]) -> list[str]:
    return [call["function"]["name"] for m in messages for call in m.get("tool_calls") or []]


def _parse_json(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise RecipeError("data.train", f"{what} is not valid JSON ({err.msg} at column {err.colno}): "
                          f"{text[:80]!r}", fix="write it as a JSON object (or a list of them)") from err


def load_tools(tools: str | list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """``data.tools``: a list of tool schemas, or the path of a JSON file holding one."""
    if isinstance(tools, str):
        from pathlib import Path

        try:
            tools = json.loads(Path(tools).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as err:
            raise RecipeError("data.tools", f"cannot read {tools}: {err}",
                              fix="point data.tools at a JSON file holding a list of tool schemas") from err
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise RecipeError("data.tools", "the file must hold a JSON list of tool schemas (objects)")
    return tools or None


def uses_tools(raw, tools: list[dict[str, Any]] | None) -> bool:
    """Whether a chat dataset offers tools or calls them: ``data.tools``, a ``tools`` column, messages with a
    ``tool_calls`` key or ``tool_call`` content parts, or ShareGPT ``function_call`` turns (read from Arrow, without a
    Python loop over rows)."""
    import pyarrow.compute as pc

    if tools or TOOLS_COLUMN in raw.column_names:
        return True
    table = raw.with_format("arrow")
    for column, key, test in (("messages", "tool_calls", None), ("conversations", "from", "function_call")):
        if column not in raw.column_names:
            continue
        turns = pc.list_flatten(table[column])
        if not hasattr(turns.type, "get_field_index") or turns.type.get_field_index(key) < 0:
            continue
        values = pc.struct_field(turns, key)
        found = pc.any(pc.equal(values, test)).as_py() if test else values.null_count < len(values)
        if found:
            return True
    return "messages" in raw.column_names and _has_tool_call_parts(pc.list_flatten(table["messages"]))


def _has_tool_call_parts(turns) -> bool:
    import pyarrow.compute as pc

    if not hasattr(turns.type, "get_field_index") or turns.type.get_field_index("content") < 0:
        return False
    content = pc.struct_field(turns, "content")
    if not hasattr(content.type, "value_type"):  # string content (or Json, read row by row elsewhere)
        return False
    parts = pc.list_flatten(content)
    if not hasattr(parts.type, "get_field_index") or parts.type.get_field_index("type") < 0:
        return False
    return bool(pc.any(pc.equal(pc.struct_field(parts, "type"), "tool_call")).as_py())
