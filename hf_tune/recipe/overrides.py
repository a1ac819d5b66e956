"""YAML as users write it (YAML 1.2 scalars), and ``section.key=value`` overrides applied to a raw recipe."""

from __future__ import annotations

import copy
import re
from typing import Any

import yaml

from hf_tune.errors import RecipeError


class RecipeYamlLoader(yaml.SafeLoader):
    """YAML as users expect it (YAML 1.2 scalars): only true/false are booleans, so ``eval_strategy: no`` stays the
    string "no" (YAML 1.1 reads False), and ``1e-4`` is a float (YAML 1.1 reads a string)."""


RecipeYamlLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
RecipeYamlLoader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                                       list("tTfF"))
RecipeYamlLoader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9]+[eE][-+]?[0-9]+$"),
                                       list("-+0123456789"))


def read_yaml(text: str):
    return yaml.load(text, Loader=RecipeYamlLoader)


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``section.key=value`` overrides; the value is read as YAML (``3`` is an int, ``[a, b]`` a list)."""
    raw = copy.deepcopy(raw)
    for item in overrides:
        dotted, sep, text = item.partition("=")
        parts = dotted.strip().split(".")
        if not sep or len(parts) < 2 or not all(parts):
            raise RecipeError(f"override {item!r}", "expected section.key=value", fix="e.g. training.learning_rate=1e-4")
        _set_dotted(raw, dotted.strip(), read_yaml(text) if text.strip() else None)
    return raw


def apply_values(raw: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``raw`` with dotted keys set to already-typed values (search trials, best recipes)."""
    raw = copy.deepcopy(raw)
    for dotted, value in values.items():
        _set_dotted(raw, dotted, value)
    return raw


def _set_dotted(raw: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = raw
    for part in parents:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, dict):
            raise RecipeError(dotted, f"cannot set a key inside '{part}', which holds {child!r}")
        node = child
    node[leaf] = value
