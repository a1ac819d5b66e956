"""The search space as a recipe declares it, for any backend: categorical choices that are lists or mappings, and
conditional keys (``when``). Pure: no Optuna, no Ray.

Optuna's categorical choices must be None, bool, int, float or str (its storage keeps them as such), so a choice such
as ``[q_proj, v_proj]`` is encoded as its JSON text for the sampler and decoded back for the trial's recipe; the
study's tables and plots show the text.

``when: {key: value}`` searches a key only when another key has that value (a list: one of those values). The other
key is a searched one (its value in this trial) or one the recipe sets (``method``, ``training.optim`` ...). A key
whose condition fails keeps the recipe's value, and the trial has no parameter for it.
"""

from __future__ import annotations

import copy
import json
from typing import Any, Callable

from hf_tune.catalog.search_backends import DEFAULT_SEARCH_BACKEND, SEARCH_BACKENDS
from hf_tune.errors import RecipeError

_MISSING = object()


def encode_choice(value: Any) -> Any:
    """A choice as Optuna can store it: lists and mappings as their JSON text, scalars as they are."""
    return json.dumps(value, sort_keys=True) if isinstance(value, (list, tuple, dict)) else value


def encoded_choices(dist) -> list[Any]:
    return [encode_choice(choice) for choice in dist.choices]


def decode_choice(dist, value: Any) -> Any:
    """The declared choice a sampler's (encoded) value stands for; values of other distributions as they are."""
    if dist.type != "categorical":
        return value
    for choice in dist.choices:
        if encode_choice(choice) == value and type(encode_choice(choice)) is type(value):
            return copy.deepcopy(choice)
    return value


def recipe_value(raw: dict[str, Any], dotted: str) -> Any:
    """The value at a dotted key of a raw recipe (``method``, ``training.optim``), or ``_MISSING``."""
    node: Any = raw
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def condition_holds(when: dict[str, Any] | None, values: dict[str, Any], raw: dict[str, Any],
                    searched: set[str] | frozenset[str] = frozenset()) -> bool:
    """Every key of ``when`` has one of its values: a searched key (in ``searched``) its value in ``values`` (this
    trial's, decoded; absent when that key is inactive, which fails the condition), any other key its value in the
    recipe ``raw``."""
    for key, wanted in (when or {}).items():
        value = values.get(key, _MISSING) if key in searched else recipe_value(raw, key)
        options = wanted if isinstance(wanted, list) else [wanted]
        if value is _MISSING or not any(value == option for option in options):
            return False
    return True


def search_order(space: dict[str, Any]) -> list[str]:
    """The space's keys, each after the searched keys its condition names (the order a trial samples them in)."""
    order: list[str] = []
    visiting: list[str] = []

    def visit(key: str) -> None:
        if key in order:
            return
        if key in visiting:
            cycle = " -> ".join([*visiting[visiting.index(key):], key])
            raise RecipeError(f"search.space.{key}.when", f"conditions form a cycle: {cycle}",
                              fix="make one of these keys unconditional")
        visiting.append(key)
        for other in space[key].when or {}:
            if other in space:
                visit(other)
        visiting.pop()
        order.append(key)

    for key in space:
        visit(key)
    return order


def sample_space(space: dict[str, Any], raw: dict[str, Any], draw: Callable[[str, Any], Any]) -> dict[str, Any]:
    """The trial's ``{dotted key: value}``: ``draw(key, dist)`` (decoded) for each key whose condition holds, in
    ``search_order``; ``raw`` is the recipe the trial starts from."""
    values: dict[str, Any] = {}
    for key in search_order(space):
        if condition_holds(space[key].when, values, raw, set(space)):
            values[key] = draw(key, space[key])
    return values


def check_space(space: dict[str, Any], raw: dict[str, Any], sampler: str) -> None:
    """Load-time checks of the space's structure: distinct encoded choices, conditions that name a searched key or
    one the recipe sets, with values that key can take, and no cycle."""
    for key, dist in space.items():
        if dist.type == "categorical":
            encoded = encoded_choices(dist)
            if len({json.dumps(e) for e in encoded}) != len(encoded):
                raise RecipeError(f"search.space.{key}.choices", "has the same choice twice (a string may not spell "
                                  "the JSON of a list or mapping choice)", fix="list each choice once")
        for other, wanted in (dist.when or {}).items():
            path = f"search.space.{key}.when.{other}"
            if other == key:
                raise RecipeError(path, "a key cannot be conditional on itself")
            options = wanted if isinstance(wanted, list) else [wanted]
            if other in space:
                target = space[other]
                if target.type == "categorical" and not any(o in target.choices for o in options):
                    raise RecipeError(path, f"none of {options} is among the choices of {other}: the key would never "
                                      "be searched", fix=f"use one of {target.choices}")
            elif recipe_value(raw, other) is _MISSING:
                raise RecipeError(path, f"{other!r} is neither searched nor set in the recipe",
                                  fix="name a key of search.space, or a key the recipe sets "
                                      "(method, training.optim ...)")
        if dist.when and sampler == "grid":
            raise RecipeError(f"search.space.{key}.when", "the grid sampler needs every key in every trial",
                              fix="use another sampler (tpe, random), or remove the condition")
    search_order(space)


# Keys whose value shapes the weights: PBT never mutates them (a trial that copies another's checkpoint takes the
# donor's values with its weights).
_SHAPE_SECTIONS = ("lora", "model")


def check_search_settings(recipe) -> None:
    """The search section's structure, backend and scheduler agree (made when the recipe loads)."""
    import importlib.util

    search = recipe.search
    raw = {k: v for k, v in recipe.to_dict().items() if k != "search"}
    check_space(search.space, raw, search.sampler)
    multi = isinstance(search.metric, list) and len(search.metric) > 1
    if search.terminator != "none" and multi:
        raise RecipeError("search.terminator", "Optuna's Terminator judges single-objective studies",
                          fix="set terminator: none, or search one metric")
    backend = SEARCH_BACKENDS[search.backend]
    for other in SEARCH_BACKENDS.values():  # another backend's own keys, set
        for key in set(other.own_keys) - set(backend.own_keys):
            if getattr(search, key):
                raise RecipeError(f"search.{key}", f"applies to search.backend: {other.name}",
                                  fix=f"set search.backend: {other.name}, or remove it")
    if "scheduler" not in backend.own_keys:  # the checks below are of a trial scheduler's backend (Ray Tune)
        return
    if backend.package is not None and importlib.util.find_spec(backend.package) is None:
        raise RecipeError("search.backend", f"{backend.name} needs {backend.title}, which is not installed",
                          fix=f"pip install 'hf_tune[{backend.extra}]'")
    if backend.objectives is not None and isinstance(search.metric, list) and len(search.metric) > backend.objectives:
        raise RecipeError("search.metric", f"backend {backend.name} searches {backend.objectives} metric(s)",
                          fix=f"use backend {DEFAULT_SEARCH_BACKEND} for several")
    if backend.samplers and (search.sampler not in backend.samplers or search.terminator != "none"):
        key = "sampler" if search.sampler not in backend.samplers else "terminator"
        raise RecipeError(f"search.{key}", f"applies to backend {DEFAULT_SEARCH_BACKEND}; backend {backend.name} "
                          f"samples the space with {', '.join(backend.samplers)} and lets its scheduler stop or "
                          "exploit trials", fix=f"remove search.{key}")
    if backend.samplers and search.sampler == "grid" and any(d.type != "categorical" for d in search.space.values()):
        raise RecipeError("search.sampler", f"grid on backend {backend.name} takes categorical keys",
                          fix="list the values as choices")
    scheduler = search.scheduler or "asha"
    evaluating = str(recipe.training.get("eval_strategy", "no")) != "no"
    if scheduler != "none" and not evaluating:
        raise RecipeError("search.scheduler", f"{scheduler} acts on the metrics each evaluation reports",
                          fix="set training.eval_strategy: steps (and eval_steps), or search.scheduler: none")
    if scheduler == "pbt":
        if all(key.split(".")[0] in _SHAPE_SECTIONS for key in search.space):
            raise RecipeError("search.space", "PBT mutates training and optim keys during training; lora and model "
                              "keys shape the weights, so they are sampled once per trial and never mutated, and "
                              "this space has nothing else", fix="add a training or optim key (learning_rate ...), "
                              "or use scheduler asha")
        for key, dist in search.space.items():
            if key in ("method", "rewards"):
                raise RecipeError(f"search.space.{key}", "PBT mutates keys during a trial, and a trial trains one "
                                  f"{key}", fix="use scheduler asha (or none), or run one PBT study per choice")
            if dist.when:
                raise RecipeError(f"search.space.{key}.when", "PBT mutates every key at each perturbation",
                                  fix="remove the condition, or use scheduler asha")
        if str(recipe.training.get("eval_strategy")) != "steps":
            raise RecipeError("training.eval_strategy", "PBT exploits from the checkpoint of each evaluation",
                              fix="set training.eval_strategy: steps and eval_steps")


def trial_reads_base_data(trial, base) -> bool:
    """The data read once for the study fits this trial's recipe: a trial with another method (``search.space.
    method``: KTO unpairs what DPO reads as pairs) or another reward list (whose columns are checked against the data)
    reads its own."""
    return trial.method == base.method and trial.rewards == base.rewards
