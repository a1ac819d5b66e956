"""The recipe's model on the meta device: every parameter's shape and dtype, no weight read or allocated. ``plan`` and
``init`` size a 70B run with it on a laptop, offline when the model's config ships with hf_tune (``configs/``)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from hf_tune.catalog.tasks import task_of
from hf_tune.errors import RecipeError
from hf_tune.model.loading import lora_section, model_config, task_model_class
from hf_tune.model.vision import freeze_vision_tower, freezes_vision
from hf_tune.recipe.schema import Recipe

logger = logging.getLogger(__name__)

SHIPPED_CONFIGS = Path(__file__).parent / "configs"


def shipped_config_path(name: str) -> Path | None:
    """The ``config.json`` hf_tune ships for the Hub id ``name`` (``configs/ORG--NAME.json``), or None."""
    path = SHIPPED_CONFIGS / f"{name.replace('/', '--')}.json"
    return path if "/" in name and path.is_file() else None


def shipped_model_ids() -> list[str]:
    """Hub ids whose config ships with hf_tune."""
    return sorted(p.stem.replace("--", "/", 1) for p in SHIPPED_CONFIGS.glob("*.json"))


def load_model_config(recipe: Recipe):
    """The model's config from where ``from_pretrained`` finds it (local folder, Hub cache, the Hub), else, for a Hub
    id whose config ships with hf_tune, from that file: the one file a plan needs, which the weights never are."""
    from transformers import AutoConfig

    m = recipe.model
    try:
        return model_config(recipe)
    except RecipeError:
        shipped = shipped_config_path(m.pretrained_model_name_or_path)
        if shipped is None or m.revision or m.subfolder:
            raise
        logger.info("%s is neither local nor reachable: planning from hf_tune's copy of its config.json (%s)",
                    m.pretrained_model_name_or_path, shipped.name)
        return AutoConfig.from_pretrained(str(shipped))


def config_model_class(recipe: Recipe, config=None) -> type:
    """The class ``from_pretrained`` will build for the recipe's task, from the model's config alone (the shipped
    one when the model's files are out of reach)."""
    config = config or load_model_config(recipe)
    return task_model_class(recipe, config)


def meta_dtype(recipe: Recipe, config) -> torch.dtype:
    """The dtype the weights load in: ``model.dtype``, or as the config says when it is ``auto`` or unset (the default
    of ``from_pretrained`` in transformers 5), float32 when the config says nothing."""
    name = recipe.model.dtype
    if name in (None, "auto"):
        name = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32"
    return name if isinstance(name, torch.dtype) else getattr(torch, str(name).removeprefix("torch."))


def build_meta_model(recipe: Recipe, labels: list[str] | None = None):
    """The model a run trains, on the meta device: the task's head (``labels``: a classifier's class names) and, with a
    ``lora`` section, PEFT's adapters as training adds them (tokens a chat template adds are not counted)."""
    from peft import LoraConfig, get_peft_model

    config = load_model_config(recipe)
    task = task_of(recipe.model.task)
    num_labels = task.num_labels or (len(labels) if labels else None) or recipe.model.num_labels
    if num_labels is not None:
        config.num_labels = num_labels
    # The class itself, not from_config: under a ZeRO-3 config (the recipe's TrainingArguments) from_config would
    # partition the model with deepspeed.zero.Init, which starts a process group. The default dtype is the one
    # from_pretrained gives the weights; the meta device ties shared weights as a real one (init_empty_weights not).
    cls, dtype = config_model_class(recipe, config), meta_dtype(recipe, config)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = cls(config)
            if freezes_vision(recipe):
                freeze_vision_tower(model)
            if recipe.lora is not None:
                model = get_peft_model(model, LoraConfig(task_type=task.peft_task_type,
                                                         **lora_section(model, recipe)))
    finally:
        torch.set_default_dtype(previous)
    return model
