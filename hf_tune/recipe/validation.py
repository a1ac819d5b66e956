"""A raw recipe (a dict) -> a validated ``Recipe``: every section against its schema or its upstream class, files
that must exist, and the checks across sections. Pure: no network, no model, no process group."""

from __future__ import annotations

import glob
import os
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from hf_tune.catalog.methods import DEFAULT_METHOD, METHODS
from hf_tune.catalog.sources import LOCAL_DATA_SUFFIXES, PACKAGED_BUILDERS, data_file_patterns, looks_like_local_path
from hf_tune.catalog.templates import names_a_template, template_names
from hf_tune.errors import HfTuneError, RecipeError
from hf_tune.recipe.agent_section import AgentSection
from hf_tune.recipe.checks import check_consistency, check_method, check_search
from hf_tune.recipe.overrides import TOP_LEVEL_KEYS, apply_values
from hf_tune.recipe.resilience_section import ResilienceSection, check_resilience
from hf_tune.recipe.schema import (
    SECTIONS,
    DataSection,
    EvaluationSection,
    HubSection,
    MachineSection,
    ModelSection,
    OptimSection,
    ProfileSection,
    Recipe,
    SearchSection,
    TrackingSection,
)
from hf_tune.recipe.upstream import check_lora_values, check_training_values, check_upstream_kwargs, did_you_mean
from hf_tune.redaction import is_secret_key, refuse_secrets, unknown_key

# Keys the recipe sets in its own sections, never inside `lora` (peft.LoraConfig).
_LORA_RESERVED = {"task_type": "it follows model.task; remove lora.task_type"}


def validate_recipe(raw: dict[str, Any], source: Path | None = None) -> Recipe:
    refuse_secrets(raw, keys=False)  # token-shaped values first: no later message may echo one
    for section in raw:
        if section not in SECTIONS:
            raise RecipeError(str(section), f"unknown section; a recipe has {', '.join(SECTIONS)}",
                              fix=did_you_mean(str(section), SECTIONS))
    for section in ("model", "data"):
        if not raw.get(section):
            raise RecipeError(section, "required section is missing")
    method = _parse_method(raw)
    model = _parse_section(ModelSection, _method_default(raw["model"], "task", method.tasks[0], "model"), "model")
    data = _parse_section(DataSection, _method_default(raw["data"], "format", method.formats[0], "data"), "data")
    optim = _parse_section(OptimSection, raw.get("optim") or {}, "optim")
    evaluation = _parse_section(EvaluationSection, raw.get("evaluation") or {}, "evaluation")
    hub = _parse_section(HubSection, raw.get("hub") or {}, "hub")
    search = _parse_section(SearchSection, raw["search"], "search") if raw.get("search") is not None else None
    tracking = _parse_section(TrackingSection, raw.get("tracking") or {}, "tracking")
    profile = _parse_section(ProfileSection, raw["profile"] or {}, "profile") if "profile" in raw else None
    resilience = _parse_section(ResilienceSection, raw.get("resilience") or {}, "resilience")
    machine = (_parse_section(MachineSection, raw["machine"] or {}, "machine") if raw.get("machine") is not None
               else None)
    teacher = _parse_section(ModelSection, raw["teacher"], "teacher") if raw.get("teacher") is not None else None
    agent = _parse_section(AgentSection, raw["agent"], "agent") if raw.get("agent") is not None else None

    from peft import LoraConfig

    lora = raw.get("lora")
    if lora is not None:
        lora = check_upstream_kwargs("lora", lora, LoraConfig, reserved=_LORA_RESERVED)
        check_lora_values(lora)
    training = dict(raw.get("training") or {})
    if training.get("resume_from_checkpoint") is False:  # `false` reads better in YAML than 'never'
        training["resume_from_checkpoint"] = "never"
    training = check_upstream_kwargs("training", training, method.config)
    check_training_values(training)
    if not training.get("output_dir"):
        training["output_dir"] = str(Path("runs") / (source.stem if source else "run"))
    refuse_secrets(raw)  # secret-named keys, once every key is known: a mistyped key is reported as a typo first
    recipe = Recipe(model=model, data=data, training=training, lora=lora, optim=optim, evaluation=evaluation,
                    hub=hub, search=search, tracking=tracking, profile=profile, resilience=resilience, machine=machine,
                    method=method.name, rewards=list(raw.get("rewards") or []), agent=agent, teacher=teacher,
                    source=source)
    check_method(recipe, raw)
    _check_files(recipe)
    check_consistency(recipe, optim_given="optim" in raw)
    check_resilience(recipe)
    if recipe.search is not None:
        _check_search_space(recipe)
        check_search(recipe)
    return recipe


SEARCHABLE_SECTIONS = ("training", "lora", "optim", "model")
SEARCHABLE_TOP_LEVEL = TOP_LEVEL_KEYS  # method (methods reading the same data) and rewards (GRPO's reward lists)


def _check_search_space(recipe: Recipe) -> None:
    """Every space key is a valid recipe key: the recipe validates with the key's first (or lowest) value, and with
    every choice of a top-level key (a method or a reward list changes what the whole recipe means)."""
    base = {k: v for k, v in recipe.to_dict().items() if k != "search"}
    for key, dist in recipe.search.space.items():
        path = f"search.space.{key}"
        section = key.split(".")[0]
        if key in SEARCHABLE_TOP_LEVEL:
            _check_top_level_choices(recipe, base, key, dist)
            continue
        if "." not in key or section not in SEARCHABLE_SECTIONS:
            raise RecipeError(path, f"cannot be searched: keys of {', '.join(SEARCHABLE_SECTIONS)} can, and "
                              f"{' and '.join(SEARCHABLE_TOP_LEVEL)} (data keys would need the data tokenized again "
                              "for every trial)")
        if section == "lora" and recipe.lora is None:
            raise RecipeError(path, "the recipe has no lora section", fix="add a lora section to search its keys")
        try:
            validate_recipe(apply_values(base, {key: dist.first_value}))
        except HfTuneError as err:
            raise RecipeError(path, str(err).removeprefix(f"{key}: ")) from None


def _check_top_level_choices(recipe: Recipe, base: dict[str, Any], key: str, dist) -> None:
    """``method`` or ``rewards`` takes choices, each of which makes a valid recipe; searched methods read the
    recipe's data format (the data is read in that format for every trial)."""
    path = f"search.space.{key}"
    if dist.type != "categorical":
        raise RecipeError(path, f"{key} takes a list of choices", fix=f"search.space.{key}: {{choices: [...]}}")
    if key == "method":
        fmt = recipe.data.format
        others = [c for c in dist.choices if isinstance(c, str) and c in METHODS and fmt not in METHODS[c].formats]
        if others:
            read = "; ".join(f"{c} reads {' or '.join(METHODS[c].formats)}" for c in others)
            raise RecipeError(path, f"the choices read different data formats: data.format is {fmt!r}, but {read}",
                              fix="search methods that read the recipe's data (e.g. dpo and kto on preference "
                                  "data), or run one search per method")
    for index, choice in enumerate(dist.choices):
        try:
            validate_recipe(apply_values(base, {key: choice}))
        except HfTuneError as err:
            raise RecipeError(f"{path}.choices[{index}]", str(err)) from None


def _parse_method(raw: dict[str, Any]):
    name = raw.get("method") or DEFAULT_METHOD
    if not isinstance(name, str) or name not in METHODS:
        raise RecipeError("method", f"unknown method {name!r}; one of {', '.join(METHODS)}",
                          fix=did_you_mean(str(name), METHODS))
    return METHODS[name]


def _method_default(values: Any, key: str, default: str, section: str) -> Any:
    """The section with the method's default for ``key`` where the recipe is silent (the model head of a reward
    model, the data format of a preference method)."""
    if not isinstance(values, dict) or key in values:
        return values
    return {**values, key: default}


def _parse_section(cls: type[BaseModel], values: Any, section: str) -> BaseModel:
    if not isinstance(values, dict):
        raise RecipeError(section, f"expected a mapping, got {values!r}")
    try:
        return cls.model_validate(values)
    except ValidationError as err:
        problems = [_describe(cls, section, e) for e in err.errors()]
        raise HfTuneError("\n".join(str(p) for p in problems)) if len(problems) > 1 else problems[0] from None


_UNION_TAGS = {"source", "sources"}  # the branches of data.train (one source, or a list): not part of a key


def _describe(cls: type[BaseModel], section: str, error: dict[str, Any]) -> RecipeError:
    parts = [part for part in error["loc"] if part not in _UNION_TAGS]
    loc = [str(part) for part in parts]
    path = section + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in parts)
    if error["type"] == "extra_forbidden":
        return unknown_key(path, "unknown key", did_you_mean(loc[-1], _fields_at(cls, loc[:-1])))
    if error["type"] == "missing":
        return RecipeError(path, "required key is missing")
    if not loc:  # a check across keys of the section
        return RecipeError(section, error["msg"].removeprefix("Value error, "))
    shown = "a value not shown: the key names a secret" if is_secret_key(loc[-1]) else repr(error.get("input"))
    return RecipeError(path, f"{error['msg']} (got {shown})")


def _fields_at(cls: type[BaseModel], loc: list[str]) -> list[str]:
    for part in loc:
        if part.isdigit():  # an index into a list of sections
            continue
        nested = _models_in(cls.model_fields[part].annotation)
        if not nested:
            return []
        cls = nested[0]
    return list(cls.model_fields)


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models inside an annotation (through unions, lists and Annotated)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def _check_files(recipe: Recipe) -> None:
    """Local files the recipe names must exist (a Hub id's availability is a preflight check: it needs the network)."""
    for key, model in (("model", recipe.model), ("teacher", recipe.teacher)):
        model_name = model.pretrained_model_name_or_path if model else ""
        if looks_like_local_path(model_name) and not os.path.isdir(os.path.expanduser(model_name)):
            raise RecipeError(f"{key}.pretrained_model_name_or_path", f"no such folder: {model_name}",
                              fix="name a folder holding config.json, a Hub id (org/name), or "
                                  "embedded:SmolLM2-135M-Instruct")
    sources = recipe.data.train_sources + ([("data.eval", recipe.data.eval)] if recipe.data.eval else [])
    for name, source in sources:
        if Path(source.path).suffix in LOCAL_DATA_SUFFIXES and not Path(source.path).is_file():
            raise RecipeError(f"{name}.path", f"file not found: {source.path}",
                              fix="paths are relative to the folder you run from")
        if source.path in PACKAGED_BUILDERS:  # data_files are local files then (Hub datasets resolve their own)
            for pattern in data_file_patterns(source.data_files):
                if "://" not in pattern and not glob.glob(os.path.expanduser(pattern)):
                    raise RecipeError(f"{name}.data_files", f"no file matches {pattern}")
    tools = recipe.data.tools
    if isinstance(tools, str) and not Path(tools).is_file():
        raise RecipeError("data.tools", f"file not found: {tools}", fix="a .json file holding a list of tool schemas")
    template = recipe.data.chat_template
    if template and names_a_template(template):
        names = template_names()
        if template not in names:
            close = did_you_mean(template, names)
            raise RecipeError("data.chat_template", f"no chat template is named {template!r}",
                              fix=(f"{close} " if close else "") + "name one of hf_tune's or TRL's ("
                              f"{', '.join(sorted(names)[:6])}, ...: docs/recipe.md lists them), a .jinja file, or "
                              "give the template text itself")
    elif template and "{" not in template and not Path(template).is_file():
        raise RecipeError("data.chat_template", f"file not found: {template}", fix="give a .jinja file path, a "
                          "template's name (chatml, or one of TRL's), or the template text itself")
