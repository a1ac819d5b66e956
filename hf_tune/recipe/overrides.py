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


TOP_LEVEL_KEYS = ("method", "rewards")  # recipe keys that are values, not sections: set as ``method=kto``


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``section.key=value`` (and ``method=NAME``, ``rewards=[...]``, ``rewards.0.weight=2``) overrides; the
    value is read as YAML (``3`` is an int, ``[a, b]`` a list)."""
    raw = copy.deepcopy(raw)
    for item in overrides:
        dotted, sep, text = item.partition("=")
        parts = dotted.strip().split(".")
        top_level = len(parts) == 1 and parts[0] in TOP_LEVEL_KEYS
        if not sep or not all(parts) or (len(parts) < 2 and not top_level):
            raise RecipeError(f"override {item!r}", f"expected section.key=value or one of {', '.join(TOP_LEVEL_KEYS)}"
                              "=value", fix="e.g. training.learning_rate=1e-4, method=kto")
        _set_dotted(raw, dotted.strip(), read_yaml(text) if text.strip() else None)
    return raw


def apply_values(raw: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``raw`` with dotted keys set to already-typed values (search trials, best recipes)."""
    raw = copy.deepcopy(raw)
    for dotted, value in values.items():
        _set_dotted(raw, dotted, value)
    return raw


def _set_dotted(raw: dict[str, Any], dotted: str, value: Any) -> None:
    """Set ``dotted`` in ``raw``, creating sections on the way; a number indexes a list (``rewards.0.weight``)."""
    *parents, leaf = dotted.split(".")
    node = raw
    for part in parents:
        if isinstance(node, list):
            node = node[_list_index(node, part, dotted)]
            continue
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, (dict, list)):
            raise RecipeError(dotted, f"cannot set a key inside '{part}', which holds {child!r}")
        node = child
    if isinstance(node, list):
        node[_list_index(node, leaf, dotted)] = value
    elif isinstance(node, dict):
        node[leaf] = value
    else:
        raise RecipeError(dotted, f"cannot set '{leaf}' inside {node!r}")


def _list_index(items: list, part: str, dotted: str) -> int:
    if not part.isdigit() or int(part) >= len(items):
        raise RecipeError(dotted, f"'{part}' is not an index of this list of {len(items)} item(s)",
                          fix=f"an index from 0 to {len(items) - 1}" if items else "set the whole list")
    return int(part)
