"""Raw examples checked against ``data.format`` before anything is tokenized: every column the format reads holds,
in every row, what the format says. The common case is decided on Arrow types and null counts, without reading rows
in Python; only when that fails are the rows read, to name the first bad one and say what it holds."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import datasets
import pyarrow as pa
import pyarrow.compute as pc
from datasets import ClassLabel, Dataset, Value

from hf_tune.data.formats import Format, check_columns, format_of, row_refusal
from hf_tune.data.images import IMAGE_KINDS, check_images
from hf_tune.data.messages import SHAREGPT_ROLES, content_problem

TURN_KEYS = {"messages": ("role", "content"), "conversations": ("from", "value")}
_OTHER_CHAT_COLUMN = {"messages": "conversations", "conversations": "messages"}
_STRING_TYPES = ("string", "large_string")


def column_rules(format: str, columns: list[str]) -> list[tuple[str, str, bool]]:
    """(column, kind, optional) for each column the format reads that the data has; kinds:
    hf_tune.catalog.formats.Column. Where the data holds several of the format's layouts (messages and conversations), a
    row may fill either."""
    spec = format_of(format)
    several = len(_complete_layouts(spec, columns)) > 1
    return [(c.name, c.kind, c.optional or several and not all(c.name in layout for layout in spec.layouts))
            for c in spec.columns if c.kind and c.name in columns]


def check_examples(dataset: Dataset, format: str, key: str, where: str,
                   line_of: Callable[[int], int | None] | None = None) -> None:
    """Raise a RecipeError naming ``key``, ``where`` (the file), the first bad example (and its line, where
    ``line_of`` maps a row to one), the column, what it holds and what the format expects."""
    check_columns(format, dataset.column_names, key, where)
    spec, refuse = format_of(format), row_refusal(format, key, where, len(dataset), line_of)
    for column, kind, optional in column_rules(format, dataset.column_names):
        if kind in IMAGE_KINDS:  # every image opened and decoded (hf_tune.data.images)
            check_images(dataset, column, refuse, kind)
            continue
        if _fits_arrow(dataset, column, kind, optional):
            continue
        for row, value in enumerate(dataset[column]):
            problem = None if value is None and optional else value_problem(value, kind, column)
            if problem:
                refuse(row, column, problem)
    layouts = _complete_layouts(spec, dataset.column_names)
    if len(layouts) > 1:  # every row fills one of them
        missing = functools.reduce(pc.and_, [functools.reduce(pc.or_, [pc.is_null(_arrow(dataset, c)) for c in layout])
                                             for layout in layouts])
        if pc.any(missing).as_py():
            refuse(pc.index(missing, True).as_py(), layouts[0][0],
                   f"neither {' nor '.join(repr(layout[0]) for layout in layouts)} is set")
    if spec.string_follows and not _pairs_fit_arrow(dataset, *spec.string_follows):
        first, second = spec.string_follows
        for row, (a, b) in enumerate(zip(dataset[first], dataset[second])):
            if isinstance(a, str) and not isinstance(b, str):
                refuse(row, second, f"the {first} is a string, so the {second} must be one too, got {_show(b)}")


def _complete_layouts(spec: Format, columns: list[str]) -> list[tuple[str, ...]]:
    return [layout for layout in spec.layouts if all(c in columns for c in layout)]


def value_problem(value: Any, kind: str, column: str) -> str | None:
    """What is wrong with one value of ``column`` for ``kind`` (None when it fits)."""
    if value is None:
        return "is missing (null)"
    if kind == "string":
        return None if isinstance(value, str) else f"expected a string, got {_show(value)}"
    if kind == "label":
        return None if isinstance(value, (str, int)) and not isinstance(value, bool) else \
            f"expected a class name (string) or a class id (integer), got {_show(value)}"
    if kind == "string|turns" and isinstance(value, str):
        return None
    return turns_problem(value, TURN_KEYS.get(column, TURN_KEYS["messages"]), column)


def turns_problem(value: Any, keys: tuple[str, str], column: str) -> str | None:
    expected = f"a list of {{{keys[0]!r}, {keys[1]!r}}} turns"
    if not isinstance(value, list):
        return f"expected {expected}, got {_show(value)}"
    for number, turn in enumerate(value, 1):
        if not isinstance(turn, dict):
            return f"turn {number}: expected an object with {keys[0]!r} and {keys[1]!r}, got {_show(turn)}"
        present = sorted(k for k, v in turn.items() if v is not None)
        if keys[1] == "content" and turn.get("content") is None and turn.get("tool_calls"):
            turn = {**turn, "content": ""}  # an assistant turn that only calls tools (OpenAI's content: null)
        if any(turn.get(k) is None for k in keys):
            other = _OTHER_CHAT_COLUMN.get(column)
            hint = f" (turns with {TURN_KEYS[other][0]!r} and {TURN_KEYS[other][1]!r} go in a {other!r} column)" \
                if other else ""
            return f"turn {number} has keys {present}, expected {keys[0]!r} and {keys[1]!r}{hint}"
        for k in keys:
            if k == "content" and isinstance(turn[k], list):  # typed parts: text, reasoning, tool calls
                problem = content_problem(turn[k], turn.get("role"))
                if problem:
                    return f"turn {number}: {problem}"
            elif not isinstance(turn[k], str):
                expected = "a string or a list of typed parts" if k == "content" else "a string"
                return f"turn {number}: {k!r} must be {expected}, got {_show(turn[k])}"
        if column == "conversations" and turn["from"] not in SHAREGPT_ROLES:
            return f"turn {number}: unknown 'from' value {turn['from']!r}, expected one of {sorted(SHAREGPT_ROLES)}"
    return None


def _fits_arrow(dataset: Dataset, column: str, kind: str, optional: bool) -> bool:
    """True when the column's type and null counts prove every row fits; False means: read the rows to find out."""
    feature = dataset.features[column]
    if isinstance(feature, Value) and feature.dtype == "null":
        return optional
    nulls_ok = optional or _arrow(dataset, column).null_count == 0
    if isinstance(feature, Value) and feature.dtype in _STRING_TYPES and kind in ("string", "string|turns"):
        return nulls_ok
    if kind == "label":
        return nulls_ok and (isinstance(feature, ClassLabel) or isinstance(feature, Value) and (
            feature.dtype in _STRING_TYPES or feature.dtype.startswith(("int", "uint"))))
    turn = _list_item(feature)
    if "turns" not in kind or not isinstance(turn, dict):
        return False
    keys = TURN_KEYS.get(column, TURN_KEYS["messages"])
    if not all(isinstance(turn.get(k), Value) and turn[k].dtype in _STRING_TYPES for k in keys):
        return False
    turns = pc.list_flatten(_arrow(dataset, column))
    fields = {k: pc.struct_field(turns, k) for k in keys}
    if not nulls_ok or any(values.null_count for values in fields.values()):
        return False
    return column != "conversations" or bool(pc.all(pc.is_in(fields["from"], pa.array(list(SHAREGPT_ROLES)))).as_py())


def _pairs_fit_arrow(dataset: Dataset, first: str, second: str) -> bool:
    """A string in ``first`` (the prompt) needs a string in ``second`` (the completion): true at once when the first
    column is not a string column or the second is one."""
    prompt, completion = dataset.features[first], dataset.features[second]
    return _list_item(prompt) is not None or isinstance(completion, Value) and completion.dtype in _STRING_TYPES


def _list_item(feature: Any) -> Any:
    """The item feature of a list feature (``datasets.List`` since datasets 4, a one-item Python list before)."""
    list_type = getattr(datasets, "List", None)
    if list_type is not None and isinstance(feature, list_type):
        return feature.feature
    return feature[0] if isinstance(feature, list) and len(feature) == 1 else None


def _arrow(dataset: Dataset, column: str) -> pa.ChunkedArray:
    return dataset.with_format("arrow")[column]


def _show(value: Any) -> str:
    kind = {str: "string", list: "list", dict: "object", bool: "boolean", int: "integer", float: "number"}.get(
        type(value), type(value).__name__)
    text = repr(value)
    return f"a {kind} ({text[:60] + '...' if len(text) > 60 else text})" if value is not None else "null"
