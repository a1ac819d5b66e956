"""Checks for the sections passed verbatim to upstream classes (``TrainingArguments``, ``peft.LoraConfig``)."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import re
import typing
from typing import Any

from pydantic import TypeAdapter, ValidationError

from hf_tune.errors import RecipeError
from hf_tune.redaction import unknown_key

# Values TrainingArguments accepts without complaint but that can only be mistakes.
_POSITIVE = ("learning_rate", "per_device_train_batch_size", "per_device_eval_batch_size",
             "gradient_accumulation_steps")
_NON_NEGATIVE = ("weight_decay", "warmup_steps", "num_train_epochs", "max_grad_norm", "adam_epsilon")


def did_you_mean(key: str, valid: typing.Iterable[str]) -> str | None:
    match = difflib.get_close_matches(key, sorted(valid), n=1, cutoff=0.6)
    return f"did you mean '{match[0]}'?" if match else None


@functools.cache
def _init_fields(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints.get(f.name, Any) for f in dataclasses.fields(cls) if f.init}


def check_upstream_kwargs(section: str, values: dict[str, Any], cls: type,
                          reserved: dict[str, str] | None = None) -> dict[str, Any]:
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
            raise unknown_key(path, f"unknown key: not an argument of {cls.__name__}", did_you_mean(key, fields))
        try:
            converted = TypeAdapter(fields[key]).validate_python(value)
        except ValidationError as err:
            raise RecipeError(path, f"expected {_type_name(fields[key])}, got {value!r}: "
                                    f"{err.errors()[0]['msg']}") from None
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
    _check_choices(training)


def _check_choices(training: dict[str, Any]) -> None:
    """Names that TrainingArguments takes as free text and that only Trainer (or accelerate) checks, once the model
    and data are built: a tracker in report_to, a torch.compile backend."""
    from accelerate.utils import DynamoBackend

    try:
        from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK
    except ImportError:  # moved: leave the check to Trainer
        INTEGRATION_TO_CALLBACK = None
    targets = training.get("report_to")
    targets = [targets] if isinstance(targets, str) else list(targets or [])
    known = sorted(INTEGRATION_TO_CALLBACK or ()) + ["all", "none"]
    for target in targets if INTEGRATION_TO_CALLBACK else []:
        if target not in known:
            raise RecipeError("training.report_to", f"unknown tracker {target!r}", fix=did_you_mean(target, known)
                              or f"use some of {', '.join(known)}")
    backend = training.get("torch_compile_backend")
    if backend is not None and str(backend).upper() not in DynamoBackend.__members__:
        choices = [name.lower() for name in DynamoBackend.__members__]
        raise RecipeError("training.torch_compile_backend", f"unknown torch.compile backend {backend!r}",
                          fix=did_you_mean(str(backend).lower(), choices) or f"use one of {', '.join(choices)}")


def check_lora_values(lora: dict[str, Any]) -> None:
    """Values ``peft.LoraConfig`` takes but the adapter cannot work with (PEFT refuses some only once it wraps the
    model, with a traceback), then ``LoraConfig``'s own checks, reported by recipe key. Pure: no model is loaded."""
    if "r" in lora and lora["r"] <= 0:
        raise RecipeError("lora.r", f"must be a positive integer (the adapter's rank), got {lora['r']!r}",
                          fix="use e.g. lora.r=8 or 16")
    if "lora_alpha" in lora and lora["lora_alpha"] <= 0:
        raise RecipeError("lora.lora_alpha", f"must be > 0 (the update is scaled by lora_alpha / r), got "
                          f"{lora['lora_alpha']!r}", fix="use e.g. twice lora.r")
    if "lora_dropout" in lora and not 0 <= lora["lora_dropout"] < 1:
        raise RecipeError("lora.lora_dropout", f"must be in [0, 1), got {lora['lora_dropout']!r}")
    from peft import LoraConfig

    try:
        LoraConfig(**lora)
    except (ValueError, TypeError) as err:
        raise RecipeError(blame_key("lora", lora, str(err)), f"peft.LoraConfig refused it: {err}") from None


def blame_key(section: str, values: dict[str, Any], message: str) -> str:
    """The recipe key an upstream error message is about, else the section. Ranked: a key the message shows with its
    value ("Got warmup_steps = -1"); a key whose text value it singles out: first, quoted, or not a plain word
    ("adamw_magic is not a valid OptimizerNames"); a key whose name it mentions; a key whose value it mentions.
    Ties go to the earliest mention. Whole words only: ``2`` is not in ``lion_32bit``, ``seed`` not in ``data_seed``."""
    ranked = []
    for order, (key, value) in enumerate(values.items()):
        name = rf"(?<!\w){re.escape(str(key))}(?!\w)"
        shown = _find(message, name + r"\s*[=:]?\s*[`'\"]?" + _value_pattern(value)) if _blamable(value) else None
        value_at = _find(message, _value_pattern(value)) if _blamable(value) else None
        singled_out = None
        if isinstance(value, str) and value_at is not None:
            quoted = _find(message, rf"[`'\"]{re.escape(value)}[`'\"]")
            singled_out = 0 if value_at == 0 else quoted if quoted is not None else \
                value_at if not value.isalpha() else None
        for rank, at in enumerate((shown, singled_out, _find(message, name), value_at)):
            if at is not None:
                ranked.append((rank, at, order, key))
                break
    return f"{section}.{min(ranked)[3]}" if ranked else section


def _blamable(value: Any) -> bool:
    return isinstance(value, (str, int, float)) and not isinstance(value, bool) and str(value) != ""


def _value_pattern(value: Any) -> str:
    """``value`` as a whole word, and a number not inside another one (``1`` is not in ``-1`` nor in ``0.1``)."""
    return rf"(?<![\w.\-]){re.escape(str(value))}(?!\w|\.\d)"


def _find(message: str, pattern: str) -> int | None:
    found = re.search(pattern, message)
    return found.start() if found else None


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")
