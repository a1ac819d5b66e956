"""Load a recipe from YAML, apply ``section.key=value`` overrides, validate it before any model is touched."""

from __future__ import annotations

import copy
import dataclasses
import glob
import os
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from hf_tune.errors import HfTuneError, RecipeError
from hf_tune.recipe.schema import (SECTIONS, DataSection, EvaluationSection, HubSection, ModelSection, OptimSection,
                                   SearchSection, TrackingSection)
from hf_tune.recipe.upstream import check_lora_values, check_training_values, check_upstream_kwargs, did_you_mean

LOCAL_DATA_SUFFIXES = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}
# Keys the recipe sets in its own sections, never inside `lora` (peft.LoraConfig).
_LORA_RESERVED = {"task_type": "it follows model.task; remove lora.task_type"}
OFFLINE_MODEL_FIX = ("without Hub access (or with HF_HUB_OFFLINE=1), point it at a local folder with config.json "
                     "and weights (made by save_pretrained, or `hf download ORG/NAME --local-dir DIR` on a machine "
                     "online), or use embedded:SmolLM2-135M-Instruct / embedded:all-MiniLM-L6-v2")
_TOKEN_VALUE = re.compile(r"\b(hf_[A-Za-z0-9]{10,}|sk-[A-Za-z0-9]{10,})\b")
PACKAGED_BUILDERS = {"json", "csv", "parquet", "text", "arrow"}
_SECRET_KEY = re.compile(r"(^|_)(token|secret|password|passwd|api_?key|key|credentials?)$", re.IGNORECASE)


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


@dataclasses.dataclass
class Recipe:
    """A validated recipe. ``training`` and ``lora`` hold upstream keyword arguments, verbatim."""

    model: ModelSection
    data: DataSection
    training: dict[str, Any]
    lora: dict[str, Any] | None = None
    optim: OptimSection = dataclasses.field(default_factory=OptimSection)
    evaluation: EvaluationSection = dataclasses.field(default_factory=EvaluationSection)
    hub: HubSection = dataclasses.field(default_factory=HubSection)
    search: SearchSection | None = None
    tracking: TrackingSection = dataclasses.field(default_factory=TrackingSection)
    source: Path | None = None

    @property
    def output_dir(self) -> Path:
        return Path(self.training["output_dir"])

    def to_dict(self) -> dict[str, Any]:
        """The resolved recipe as plain data (what ``hf-tune validate`` prints and each run folder keeps)."""
        resolved = {
            "model": self.model.model_dump(exclude_none=True),
            "lora": copy.deepcopy(self.lora),
            "data": self.data.model_dump(exclude_none=True),
            "training": copy.deepcopy(self.training),
            "optim": self.optim.model_dump(exclude_none=True),
            "evaluation": self.evaluation.model_dump(exclude_none=True),
            "hub": self.hub.model_dump(exclude_none=True),
            "search": self.search.model_dump(exclude_none=True) if self.search else None,
            "tracking": self.tracking.model_dump(exclude_none=True),
        }
        return {k: v for k, v in resolved.items() if v is not None}


def load_recipe(recipe: str | os.PathLike | dict[str, Any], overrides: list[str] | None = None) -> Recipe:
    """Read a recipe (a YAML path or an already-parsed dict), apply overrides, and validate every section."""
    source = None
    if isinstance(recipe, dict):
        raw = copy.deepcopy(recipe)
    else:
        source = Path(recipe)
        if not source.is_file():
            raise RecipeError("", f"recipe file not found: {source}", fix="pass the path of a YAML recipe, e.g. recipes/llm_lora.yaml")
        try:
            raw = read_yaml(source.read_text()) or {}
        except yaml.YAMLError as err:
            raise RecipeError("", f"{source} is not valid YAML: {err}") from None
    if not isinstance(raw, dict):
        raise RecipeError("", f"a recipe is a mapping of sections {SECTIONS}, got {type(raw).__name__}")
    raw = apply_overrides(raw, overrides or [])
    return validate_recipe(raw, source)


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


def validate_recipe(raw: dict[str, Any], source: Path | None = None) -> Recipe:
    refuse_secrets(raw)
    for section in raw:
        if section not in SECTIONS:
            raise RecipeError(str(section), f"unknown section; a recipe has {', '.join(SECTIONS)}", fix=did_you_mean(str(section), SECTIONS))
    for section in ("model", "data"):
        if not raw.get(section):
            raise RecipeError(section, "required section is missing")
    model = _parse_section(ModelSection, raw["model"], "model")
    data = _parse_section(DataSection, raw["data"], "data")
    optim = _parse_section(OptimSection, raw.get("optim") or {}, "optim")
    evaluation = _parse_section(EvaluationSection, raw.get("evaluation") or {}, "evaluation")
    hub = _parse_section(HubSection, raw.get("hub") or {}, "hub")
    search = _parse_section(SearchSection, raw["search"], "search") if raw.get("search") is not None else None
    tracking = _parse_section(TrackingSection, raw.get("tracking") or {}, "tracking")

    from peft import LoraConfig
    from transformers import TrainingArguments

    lora = raw.get("lora")
    if lora is not None:
        lora = check_upstream_kwargs("lora", lora, LoraConfig, reserved=_LORA_RESERVED)
        check_lora_values(lora)
    training = dict(raw.get("training") or {})
    if training.get("resume_from_checkpoint") is False:  # `false` reads better in YAML than 'never'
        training["resume_from_checkpoint"] = "never"
    training = check_upstream_kwargs("training", training, TrainingArguments)
    check_training_values(training)
    if not training.get("output_dir"):
        training["output_dir"] = str(Path("runs") / (source.stem if source else "run"))
    recipe = Recipe(model=model, data=data, training=training, lora=lora, optim=optim, evaluation=evaluation,
                    hub=hub, search=search, tracking=tracking, source=source)
    _check_files(recipe)
    from hf_tune.recipe.checks import check_consistency, resolve_schedule

    check_consistency(recipe, optim_given="optim" in raw)
    resolve_schedule(recipe)

    from hf_tune.training_args import build_training_arguments

    build_training_arguments(recipe)  # cross-field checks of TrainingArguments, reported by recipe key
    return recipe


def _parse_section(cls: type[BaseModel], values: Any, section: str) -> BaseModel:
    if not isinstance(values, dict):
        raise RecipeError(section, f"expected a mapping, got {values!r}")
    try:
        return cls.model_validate(values)
    except ValidationError as err:
        problems = [_describe(cls, section, e) for e in err.errors()]
        raise HfTuneError("\n".join(str(p) for p in problems)) if len(problems) > 1 else problems[0] from None


def _describe(cls: type[BaseModel], section: str, error: dict[str, Any]) -> RecipeError:
    loc = [str(part) for part in error["loc"]]
    path = ".".join([section, *loc])
    if error["type"] == "extra_forbidden":
        return RecipeError(path, "unknown key", fix=did_you_mean(loc[-1], _fields_at(cls, loc[:-1])))
    if error["type"] == "missing":
        return RecipeError(path, "required key is missing")
    if not loc:  # a check across keys of the section
        return RecipeError(section, error["msg"].removeprefix("Value error, "))
    return RecipeError(path, f"{error['msg']} (got {error.get('input')!r})")


def _fields_at(cls: type[BaseModel], loc: list[str]) -> list[str]:
    for part in loc:
        annotation = cls.model_fields[part].annotation
        nested = [a for a in getattr(annotation, "__args__", (annotation,)) if isinstance(a, type) and issubclass(a, BaseModel)]
        if not nested:
            return []
        cls = nested[0]
    return list(cls.model_fields)


def looks_like_local_path(name: str) -> bool:
    return name.startswith(("/", "./", "../", "~")) or name.count("/") > 1 or os.path.exists(name)


def _check_files(recipe: Recipe) -> None:
    model_name = recipe.model.pretrained_model_name_or_path
    if looks_like_local_path(model_name) and not os.path.isdir(os.path.expanduser(model_name)):
        raise RecipeError("model.pretrained_model_name_or_path", f"no such folder: {model_name}",
                          fix="name a folder holding config.json, a Hub id (org/name), or embedded:SmolLM2-135M-Instruct")
    elif model_name.startswith("embedded:"):
        from hf_tune.embedded import locate_embedded

        locate_embedded(model_name)
    elif not recipe.model.gguf_file and not _available_offline(model_name, recipe.model.revision):
        raise RecipeError("model.pretrained_model_name_or_path", f"the Hub is unreachable and {model_name!r} is not in "
                          "the local Hub cache", fix=OFFLINE_MODEL_FIX)
    for name in ("train", "eval"):
        source = getattr(recipe.data, name)
        if source is None:
            continue
        if Path(source.path).suffix in LOCAL_DATA_SUFFIXES and not Path(source.path).is_file():
            raise RecipeError(f"data.{name}.path", f"file not found: {source.path}", fix="paths are relative to the folder you run from")
        if source.path in PACKAGED_BUILDERS:  # data_files are local files then (Hub datasets resolve their own)
            for pattern in _as_list(source.data_files):
                if "://" not in pattern and not glob.glob(os.path.expanduser(pattern)):
                    raise RecipeError(f"data.{name}.data_files", f"no file matches {pattern}")
    template = recipe.data.chat_template
    if template and "{" not in template and not Path(template).is_file():
        raise RecipeError("data.chat_template", f"file not found: {template}", fix="give a .jinja file path or the template text itself")


def _available_offline(repo_id: str, revision: str | None) -> bool:
    from huggingface_hub import try_to_load_from_cache

    from hf_tune.hub import hub_is_reachable

    return os.path.isdir(repo_id) or hub_is_reachable() or isinstance(try_to_load_from_cache(repo_id, "config.json", revision=revision), str)


SECRET_FIX = ("keep tokens out of recipes: export HF_TOKEN=... or run `hf auth login` (W&B: WANDB_API_KEY or "
              "`wandb login`); the Hub client and the trackers read them from there")


def refuse_secrets(raw: Any, path: str = "") -> None:
    """A recipe holds no secret: it is saved in the run folder and uploaded, and Trainer pickles its arguments
    (``training_args.bin``, in every checkpoint). Any secret-named key with a value, or a token-shaped string, is an
    error."""
    if isinstance(raw, dict):
        for key, value in raw.items():
            dotted = f"{path}.{key}" if path else str(key)
            if _SECRET_KEY.search(str(key)) and value not in (None, "", False):
                raise RecipeError(dotted, "holds a secret, which would be written into recipe.yaml, run.json and "
                                  "every checkpoint's training_args.bin", fix=SECRET_FIX)
            refuse_secrets(value, dotted)
    elif isinstance(raw, (list, tuple)):
        for i, value in enumerate(raw):
            refuse_secrets(value, f"{path}[{i}]")
    elif isinstance(raw, str) and _TOKEN_VALUE.search(raw):
        raise RecipeError(path, "holds a token-shaped value (hf_... or sk-...)", fix=SECRET_FIX)


def redact_secrets(value: Any) -> Any:
    """A copy with every value under a secret-looking key (token, password, api_key, ...) replaced by '***', and
    token-shaped strings (hf_..., sk-...) masked wherever they stand."""
    if isinstance(value, dict):
        return {k: "***" if _SECRET_KEY.search(str(k)) and v not in (None, "", False) else redact_secrets(v)
                for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact_secrets(v) for v in value]
    return _TOKEN_VALUE.sub("***", value) if isinstance(value, str) else value


def _as_list(files: Any) -> list[str]:
    if files is None:
        return []
    if isinstance(files, str):
        return [files]
    if isinstance(files, dict):
        return [f for group in files.values() for f in _as_list(group)]
    return list(files)
