"""Checks for the sections passed verbatim to upstream classes (``TrainingArguments``, ``peft.LoraConfig``)."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import typing
from typing import Any

from pydantic import TypeAdapter, ValidationError

from hf_tune.errors import RecipeError

# Values TrainingArguments accepts without complaint but that can only be mistakes.
_POSITIVE = ("learning_rate", "per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps")
_NON_NEGATIVE = ("weight_decay", "warmup_steps", "num_train_epochs", "max_grad_norm", "adam_epsilon")


def did_you_mean(key: str, valid: typing.Iterable[str]) -> str | None:
    match = difflib.get_close_matches(key, sorted(valid), n=1, cutoff=0.6)
    return f"did you mean '{match[0]}'?" if match else None


@functools.cache
def _init_fields(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints.get(f.name, Any) for f in dataclasses.fields(cls) if f.init}


def check_upstream_kwargs(section: str, values: dict[str, Any], cls: type, reserved: dict[str, str] | None = None) -> dict[str, Any]:
    """Check every key of ``values`` is an init field of dataclass ``cls`` with a value of its declared type.

    Returns the values with YAML strings converted where the type asks (``"1e-4"`` -> ``1e-4``: PyYAML reads
    exponent floats without a dot as strings). ``reserved`` maps keys the recipe sets elsewhere to that place.
    """
    if not isinstance(values, dict):
        raise RecipeError(section, f"expected a mapping of {cls.__name__} arguments, got {type(values).__name__}")
    fields = _init_fields(cls)
    checked: dict[str, Any] = {}
    for key, value in values.items():
        path = f"{section}.{key}"
        if reserved and key in reserved:
            raise RecipeError(path, "is set by hf_tune", fix=reserved[key])
        if key not in fields:
            raise RecipeError(path, f"unknown key: not an argument of {cls.__name__}", fix=did_you_mean(key, fields))
        try:
            converted = TypeAdapter(fields[key]).validate_python(value)
        except ValidationError as err:
            raise RecipeError(path, f"expected {_type_name(fields[key])}, got {value!r}: {err.errors()[0]['msg']}") from None
        except Exception:  # a type pydantic cannot express: leave it to the upstream class
            converted = value
        checked[key] = converted if isinstance(value, str) and not isinstance(converted, str) else value
    return checked


def check_training_values(training: dict[str, Any]) -> None:
    for key in _POSITIVE:
        if key in training and training[key] <= 0:
            raise RecipeError(f"training.{key}", f"must be > 0, got {training[key]!r}")
    for key in _NON_NEGATIVE:
        if key in training and training[key] < 0:
            raise RecipeError(f"training.{key}", f"must be >= 0, got {training[key]!r}")


def blame_key(section: str, values: dict[str, Any], message: str) -> str:
    """The recipe key an upstream error message is about: the first key (or value) it mentions, else the section."""
    for key in values:
        if key in message:
            return f"{section}.{key}"
    for key, value in values.items():
        if isinstance(value, (str, int, float)) and not isinstance(value, bool) and str(value) in message:
            return f"{section}.{key}"
    return section


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")
