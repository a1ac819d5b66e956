"""Checks that ask a builder: is the model there (the Hub, the local cache, an embedded package), does
``TrainingArguments`` accept the section, do the FSDP wrap classes exist in the model, can a push reach the Hub.
They run after the pure recipe validation and report every problem they find at once (``hf_tune.assembly.loading``'s
``load_recipe`` runs both).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
import sys
from typing import Callable

from huggingface_hub import constants

from hf_tune.catalog.agents import check_agent
from hf_tune.catalog.sources import OFFLINE_DATASET_FIX, OFFLINE_MODEL_FIX, is_hub_dataset_id, looks_like_local_path
from hf_tune.errors import HfTuneError, RecipeError
from hf_tune.evaluation.task_sources import check_task_sources
from hf_tune.model.attention_choice import cached_kernel_commit
from hf_tune.model.embedded import is_embedded, locate_embedded
from hf_tune.model.meta import config_model_class, load_model_config, shipped_config_path
from hf_tune.optim.schedule import resolve_schedule
from hf_tune.recipe import Recipe, apply_values, validate_recipe
from hf_tune.recipe.upstream import did_you_mean
from hf_tune.records.tracking import check_trackers
from hf_tune.runtime.hub_access import RepoProblem, dataset_is_cached, hub_repo_problem, model_is_cached
from hf_tune.runtime.network import hub_is_reachable
from hf_tune.training_args import build_training_arguments

logger = logging.getLogger(__name__)


def preflight(recipe: Recipe) -> None:
    """Run every check; one problem is raised as it is, several as one report."""
    problems: list[HfTuneError] = []
    for check in CHECKS:
        try:
            check(recipe)
        except HfTuneError as err:
            problems.append(err)
    if len(problems) == 1:
        raise problems[0]
    if problems:
        raise HfTuneError(f"{len(problems)} problems in the recipe:\n" + "\n".join(f"- {p}" for p in problems))


def _check_model_source(recipe: Recipe) -> None:
    """A Hub id must be readable: online, the repo and revision exist and are not gated for this token; offline,
    the local cache holds it (or, for validate and plan, hf_tune ships its config.json)."""
    name, m = recipe.model.pretrained_model_name_or_path, recipe.model
    if is_embedded(name):
        locate_embedded(name)
        return
    if looks_like_local_path(name) or os.path.isdir(name):
        return
    key = "model.pretrained_model_name_or_path"
    if hub_is_reachable():
        _refuse_hub_problem(hub_repo_problem(name, "model", m.revision), key, "model.revision")
    elif not m.gguf_file and not model_is_cached(name, m.revision, m.subfolder, m.cache_dir):
        if shipped_config_path(name) and not (m.revision or m.subfolder):
            logger.warning("%s: the Hub is unreachable and the model is not in the local cache; validate and plan "
                           "read hf_tune's copy of its config.json, training needs its files", name)
            return
        raise RecipeError(key, f"{offline_reason()} and {name!r} is not in the local Hub cache", fix=OFFLINE_MODEL_FIX)


def _check_hub_datasets(recipe: Recipe) -> None:
    """Each Hub dataset of ``data`` must be readable: online, it exists at its revision and is not gated for this
    token; offline, the datasets cache holds it (``load_dataset`` reads nothing else then). Every source is checked."""
    sources = recipe.data.train_sources + ([("data.eval", recipe.data.eval)] if recipe.data.eval else [])
    hub_sources = [(key, source) for key, source in sources if is_hub_dataset_id(source.path)]
    online = bool(hub_sources) and hub_is_reachable()
    problems = []
    for key, source in hub_sources:
        try:
            if online:
                _refuse_hub_problem(hub_repo_problem(source.path, "dataset", source.revision), f"{key}.path",
                                    f"{key}.revision")
            elif not dataset_is_cached(source.path):
                raise RecipeError(f"{key}.path", f"{offline_reason()} and the Hub dataset {source.path!r} is not in "
                                  "the datasets cache", fix=OFFLINE_DATASET_FIX)
        except RecipeError as err:
            problems.append(err)
    if len(problems) == 1:
        raise problems[0]
    if problems:
        raise HfTuneError("\n".join(str(p) for p in problems))


def _refuse_hub_problem(problem: RepoProblem | None, key: str, revision_key: str) -> None:
    if problem is not None:
        raise RecipeError(revision_key if problem.revision else key, problem.problem, fix=problem.fix)


def _check_evaluation_tasks(recipe: Recipe) -> None:
    """Each lm-eval task of ``evaluation.tasks`` is known, and offline reads local files or the datasets cache
    (``hf_tune.evaluation.task_sources``)."""
    if recipe.evaluation.tasks and importlib.util.find_spec("lm_eval") is not None:

        check_task_sources(recipe.evaluation.tasks, lambda: None if hub_is_reachable() else offline_reason())


def offline_reason() -> str:
    return "HF_HUB_OFFLINE is set" if constants.is_offline_mode() else f"the Hub ({constants.ENDPOINT}) is unreachable"


def _check_push(recipe: Recipe) -> None:
    """Trainer's own push (``training.push_to_hub``) uploads the whole run folder as it is: the manifest with the host
    name and command line, tracker logs, and PEFT's adapter_config.json naming the local folder the base loaded from.
    ``hf-tune push`` uploads what a model repo needs, with a base others can load."""
    if recipe.training.get("push_to_hub"):
        raise RecipeError("training.push_to_hub", "Trainer's own push uploads the whole run folder: run.json (host "
                          "name, command line), tracker logs, and an adapter_config.json that names this machine's "
                          "copy of the base model", fix="remove training.push_to_hub, and after training run "
                          "`hf-tune push RUN_DIR --repo-id OWNER/NAME` (it uploads the model, tokenizer, card and "
                          "recipe, and names the base by its Hub id)")


def _check_fsdp(recipe: Recipe) -> None:
    """``training.fsdp_config.transformer_layer_cls_to_wrap`` must name block classes of the recipe's model (a typo
    otherwise fails on the cluster, after the model has loaded)."""
    training = recipe.training
    config = training.get("fsdp_config") or {}
    if not training.get("fsdp") or not isinstance(config, dict):
        return
    key = next((k for k in ("transformer_layer_cls_to_wrap", "fsdp_transformer_layer_cls_to_wrap") if k in config),
               None)
    if key is None:
        return
    from torch import nn

    cls = config_model_class(recipe)
    module = sys.modules[cls.__module__]
    blocks = {name for name, obj in vars(module).items() if isinstance(obj, type) and issubclass(obj, nn.Module)}
    for name in config[key] if isinstance(config[key], list) else [config[key]]:
        if name not in blocks:
            default = getattr(cls, "_no_split_modules", None) or sorted(blocks)
            raise RecipeError(f"training.fsdp_config.{key}", f"{name!r} is not a module class of {cls.__name__}",
                              fix=did_you_mean(name, sorted(blocks)) or f"use {default} (or remove the key: the "
                              "model's own _no_split_modules are wrapped by default)")


def _check_training_arguments(recipe: Recipe) -> None:
    """The schedule (optim.min_lr_ratio against training.lr_scheduler_type), then TrainingArguments' own cross-field
    checks, reported by recipe key."""
    build_training_arguments(recipe)


def _check_search_samples(recipe: Recipe) -> None:
    """A trial's values must also pass the schedule and TrainingArguments' checks: the recipe with each searched
    key at its first (or lowest) value is built as far as TrainingArguments."""
    if recipe.search is None:
        return
    base = {k: v for k, v in recipe.to_dict().items() if k != "search"}
    for key, dist in recipe.search.space.items():
        try:
            trial = validate_recipe(apply_values(base, {key: dist.first_value}), recipe.source)
            trial = dataclasses.replace(trial, training=resolve_schedule(trial.training, trial.optim))
            build_training_arguments(trial)
        except HfTuneError as err:
            raise RecipeError(f"search.space.{key}", str(err).removeprefix(f"{key}: ")) from None


def _check_lora_init(recipe: Recipe) -> None:
    """PEFT computes LoftQ's initialisation on a CUDA or XPU device (it moves the weights there): on a machine with
    neither, wrapping the model would fail after it loaded."""
    if (recipe.lora or {}).get("init_lora_weights") != "loftq":
        return
    import torch

    if not (torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available())):
        raise RecipeError("lora.init_lora_weights", "loftq: PEFT computes LoftQ's initialisation on a CUDA or XPU "
                          "device, and this machine has neither", fix="use pissa or olora (they run on CPU), or true")


# flash attention packages: transformers' attn_implementation -> (module, how to install it)
FLASH_PACKAGES = {
    "flash_attention_2": ("flash_attn", "pip install flash-attn --no-build-isolation (CUDA, Ampere or newer)"),
    "flash_attention_3": ("flash_attn_interface", "build FA3 from source (Hopper GPUs): git clone "
                          "https://github.com/Dao-AILab/flash-attention && cd flash-attention/hopper && "
                          "python setup.py install"),
}


def _check_flash_attention_installed(recipe: Recipe) -> None:
    """``model.attn_implementation: flash_attention_2`` (or _3) needs its package, or transformers' Hub kernel already
    in the local cache (``kernels`` installed); else the model would fail to build, after the data is read."""
    name = recipe.model.attn_implementation
    if name not in FLASH_PACKAGES or importlib.util.find_spec(FLASH_PACKAGES[name][0]) is not None:
        return
    from transformers.modeling_flash_attention_utils import FLASH_ATTN_KERNEL_FALLBACK


    if importlib.util.find_spec("kernels") is not None and cached_kernel_commit(FLASH_ATTN_KERNEL_FALLBACK[name]):
        return
    raise RecipeError("model.attn_implementation", f"is {name!r}, but the {FLASH_PACKAGES[name][0]} package is not "
                      "installed (nor transformers' Hub kernel for it cached)", fix=f"{FLASH_PACKAGES[name][1]}; or "
                      "remove the key: hf_tune runs flash attention where it is installed, else sdpa_varlen")


def _check_task_fits_model(recipe: Recipe) -> None:
    """The model is of the recipe's task (its config has a class for ``model.task``), read from its config alone:
    a vision-language task on a text-only model is named here, not by a processor that is not one. A config that
    cannot be read is ``_check_model_source``'s to name."""
    try:
        config = load_model_config(recipe)
    except RecipeError as err:
        if err.key == "model.pretrained_model_name_or_path" and "architecture" not in err.problem:
            return
        raise
    config_model_class(recipe, config)


CHECKS: tuple[Callable[[Recipe], None], ...] = (_check_model_source, _check_task_fits_model, _check_hub_datasets,
                                                 _check_fsdp, _check_push, _check_training_arguments,
                                                 _check_search_samples, _check_lora_init,
                                                 _check_flash_attention_installed, check_trackers,
                                                 _check_evaluation_tasks, check_agent)
