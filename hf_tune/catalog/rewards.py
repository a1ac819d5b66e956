"""Reward functions for ``method: grpo``, named in the recipe's ``rewards`` list.

Each entry is a shipped name, a ``module:function`` path, or ``{name: ..., <keyword arguments>}``. A reward function
has TRL's signature: ``f(prompts, completions, **columns) -> list[float]``, where ``columns`` are the dataset's other
columns, one value per completion. Completions are strings, or lists of messages for conversational prompts.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import re
from collections.abc import Callable
from typing import Any

from hf_tune.catalog.late_bound import resolve
from hf_tune.errors import RecipeError

_NUMBER = re.compile(r"-?\d+(?:[.,]\d+)*")


def completion_text(completion: Any) -> str:
    """The text of a completion: a string, or the content of its last message."""
    if isinstance(completion, list):
        return str(completion[-1].get("content") or "") if completion else ""
    return str(completion)


def last_number(text: str) -> str | None:
    """The last number written in ``text``, without thousands separators and trailing zeros (``1,000.50`` ->
    ``1000.5``), or None."""
    found = _NUMBER.findall(text)
    if not found:
        return None
    number = found[-1].replace(",", "")
    return number.rstrip("0").rstrip(".") if "." in number else number


def exact_answer(prompts, completions, column: str = "answer", extract: str = "last_number", **columns) -> list[float]:
    """1.0 where the completion's answer equals the example's ``column``, else 0.0. ``extract``: ``last_number``
    (the last number in the completion against the column read as a number) or ``text`` (the whole completion,
    stripped, against the column as text)."""
    if column not in columns:
        raise KeyError(f"reward exact_answer reads the dataset column {column!r}; the data has {sorted(columns)}")
    scores = []
    for completion, expected in zip(completions, columns[column]):
        text = completion_text(completion).strip()
        if extract == "last_number":
            found = last_number(text)
            scores.append(float(found is not None and found == last_number(str(expected))))
        else:
            scores.append(float(text == str(expected).strip()))
    return scores


def format_regex(prompts, completions, pattern: str, **columns) -> list[float]:
    """1.0 where the whole completion matches ``pattern`` (``re.fullmatch``, DOTALL), else 0.0."""
    compiled = re.compile(pattern, re.DOTALL)
    return [float(compiled.fullmatch(completion_text(c).strip()) is not None) for c in completions]


SHIPPED: dict[str, Callable[..., list[float]]] = {"exact_answer": exact_answer, "format_regex": format_regex}
_REQUIRED = {"format_regex": ("pattern",)}
_EXTRACT = ("last_number", "text")


def reward_spec(entry: Any, index: int) -> tuple[str, dict[str, Any]]:
    """(name, keyword arguments) of one ``rewards`` entry, checked without importing anything (pure)."""
    key = f"rewards[{index}]"
    if isinstance(entry, str):
        name, kwargs = entry, {}
    elif isinstance(entry, dict) and isinstance(entry.get("name"), str):
        name, kwargs = entry["name"], {k: v for k, v in entry.items() if k != "name"}
    else:
        raise RecipeError(key, f"expected a reward name or {{name: ..., <arguments>}}, got {entry!r}",
                          fix="e.g. rewards: [exact_answer, {name: format_regex, pattern: '.*\\d+'}]")
    if name in SHIPPED:
        missing = [arg for arg in _REQUIRED.get(name, ()) if arg not in kwargs]
        if missing:
            raise RecipeError(key, f"reward {name!r} needs {missing}", fix=f"write it as {{name: {name}, "
                              + ", ".join(f"{arg}: ..." for arg in missing) + "}")
        if name == "format_regex":
            try:
                re.compile(kwargs["pattern"])
            except re.error as err:
                raise RecipeError(f"{key}.pattern", f"not a regular expression: {err}") from None
        if kwargs.get("extract", "last_number") not in _EXTRACT:
            raise RecipeError(f"{key}.extract", f"is {kwargs['extract']!r}", fix=f"use one of {', '.join(_EXTRACT)}")
    elif ":" not in name:
        close = difflib.get_close_matches(name, SHIPPED, n=1)
        raise RecipeError(key, f"unknown reward {name!r}: shipped ones are {', '.join(SHIPPED)}, or give "
                          "'module:function'", fix=f"did you mean '{close[0]}'?" if close else None)
    return name, kwargs


def reward_columns(entry: Any, index: int) -> list[str]:
    """The dataset columns one ``rewards`` entry reads: ``column`` of exact_answer; the parameters of a
    ``module:function`` reward that neither have a default nor are given in the entry (imported to read them)."""
    name, kwargs = reward_spec(entry, index)
    if name == "exact_answer":
        return [str(kwargs.get("column", "answer"))]
    if name in SHIPPED:
        return []
    skipped = {"prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric", "environments",
               *kwargs}
    parameters = inspect.signature(_import(name, index)).parameters.values()
    return [p.name for p in parameters if p.name not in skipped and p.default is inspect.Parameter.empty
            and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]


def check_reward_columns(entries: list[Any], columns: list[str], where: str) -> None:
    """Each reward's columns are in the data (``where`` names it), so a missing one is refused as the data loads,
    before the model, not as a KeyError at the first step."""
    for index, entry in enumerate(entries):
        missing = [column for column in reward_columns(entry, index) if column not in columns]
        if missing:
            name = reward_spec(entry, index)[0]
            fix = (f"set rewards[{index}].column to the data's answer column, or add {missing[0]!r} to the data"
                   if name == "exact_answer" else f"add {missing} to the data, or give the function a default")
            raise RecipeError(f"rewards[{index}]", f"reward {name!r} reads the column(s) {missing}, which {where} "
                              f"lacks: it has {columns}", fix=fix)


def build_reward_funcs(entries: list[Any]) -> list[Callable[..., list[float]]]:
    """The recipe's reward functions, each named (TRL logs ``rewards/<name>/mean``)."""
    funcs = []
    for index, entry in enumerate(entries):
        name, kwargs = reward_spec(entry, index)
        bound = functools.partial(SHIPPED.get(name) or _import(name, index), **kwargs)
        bound.__name__ = name.rsplit(":", 1)[-1]
        funcs.append(bound)
    return funcs


def _import(path: str, index: int) -> Callable[..., list[float]]:
    try:
        func = resolve(path)
    except (ImportError, AttributeError) as err:
        raise RecipeError(f"rewards[{index}]", f"cannot import {path!r}: {err}",
                          fix="the module must be importable from where you run (PYTHONPATH), "
                              "and define the function") from None
    if not callable(func):
        raise RecipeError(f"rewards[{index}]", f"{path!r} is not a function")
    return func
