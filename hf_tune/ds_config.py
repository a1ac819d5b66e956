"""DeepSpeed configs: the bundled ones (shipped inside the package), short names, and what the recipe checks read.

A recipe names a config by its short name (``zero3``) or by a JSON path. The recipe, ``run.json`` and the model card
keep what the user wrote; only ``TrainingArguments`` gets the loaded JSON, so no absolute path of the training machine
is written anywhere.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hf_tune.errors import RecipeError

BUNDLED_DS_CONFIGS = Path(__file__).resolve().parent / "ds_configs"


def bundled_names() -> list[str]:
    return sorted(p.stem for p in BUNDLED_DS_CONFIGS.glob("*.json"))


def deepspeed_config_path(value: str) -> Path:
    """A bundled config's short name (zero2, zero3_offload, ...) or a path to a JSON file."""
    bundled = BUNDLED_DS_CONFIGS / f"{value.removesuffix('.json')}.json"
    if "/" not in value and bundled.is_file():
        return bundled
    path = Path(value).expanduser()
    if not path.is_file():
        raise RecipeError("training.deepspeed", f"file not found: {value}",
                          fix=f"a JSON path, or one of {bundled_names()}")
    return path


def load_deepspeed_config(value: str | dict[str, Any]) -> dict[str, Any]:
    """The config as a new dict (Trainer fills its "auto" values in place, so every caller gets its own copy)."""
    if isinstance(value, dict):
        return json.loads(json.dumps(value))
    path = deepspeed_config_path(value)
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise RecipeError("training.deepspeed", f"{path.name} is not valid JSON: {err}") from None
    if not isinstance(config, dict):
        raise RecipeError("training.deepspeed", f"{path.name} holds a {type(config).__name__}, not a JSON object")
    return config
