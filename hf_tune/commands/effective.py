"""What a run will use where the recipe is silent and hf_tune decides (not upstream's default): the attention, the
padding-free batches, where to resume, ``use_cpu``, bf16 on a GPU, one pack per step, the schedule. ``hf-tune
validate`` prints them in place, each marked ``# hf_tune's default``. Reads config and tokenizer files, no weight."""

from __future__ import annotations

from typing import Any

from hf_tune.data import build_collator
from hf_tune.catalog.methods import method_of
from hf_tune.model.attention import NAME as SDPA_VARLEN, default_attn_implementation
from hf_tune.model.attention_choice import flash_candidates
from hf_tune.model.loading import build_tokenizer, model_config
from hf_tune.model.meta import config_model_class
from hf_tune.recipe.schema import Recipe
from hf_tune.catalog.tasks import task_of
from hf_tune.build.training_args import computes_in_half_precision, training_kwargs
from hf_tune.trainer.preemption import saves_on_signal

MARK = "  # hf_tune's default"


def hf_tune_defaults(recipe: Recipe) -> dict[str, dict[str, Any]]:
    """{section: {key: value}} of the values hf_tune fills in for this recipe on this machine."""
    training = {key: value for key, value in training_kwargs(recipe).items()
                if key not in recipe.training and key not in ("run_name", "project")}  # those two: tracking's
    if "resume_from_checkpoint" not in recipe.training:  # a recipe's own `auto` is the recipe's, not marked
        training["resume_from_checkpoint"] = "auto"
    if "enable_jit_checkpoint" not in recipe.training:
        training["enable_jit_checkpoint"] = saves_on_signal(recipe)  # upstream's default: off
    defaults = {"training": training}
    if not method_of(recipe.method).uses_trl and task_of(recipe.model.task).causal:
        attention, padding_free = _attention_and_padding_free(recipe)
        if recipe.model.attn_implementation is None:
            defaults["model"] = {"attn_implementation": attention}
        if recipe.data.padding_free is None:
            defaults["data"] = {"padding_free": padding_free}
    return defaults


def _attention_and_padding_free(recipe: Recipe) -> tuple[str, bool]:
    """The attention ``build_model`` will choose (its rule: sdpa_varlen where the packing probe proved it exact, flash
    instead on a GPU where installed) and the collator's padding-free decision under it."""
    import torch

    config = model_config(recipe)
    model_class = config_model_class(recipe, config)
    attention = recipe.model.attn_implementation
    if attention is None:
        attention = "sdpa"  # transformers' own choice
        if default_attn_implementation(True, model_class, config) == SDPA_VARLEN:
            attention = SDPA_VARLEN
            on_gpu = torch.cuda.is_available() and not recipe.training.get("use_cpu")
            if on_gpu and computes_in_half_precision(recipe):
                attention = next(iter(flash_candidates(torch.cuda.get_device_capability())), SDPA_VARLEN)
    collator = build_collator(recipe, build_tokenizer(recipe), model_class, attention)
    return attention, bool(collator.padding_free)


def mark_defaults(text: str, defaults: dict[str, dict[str, Any]]) -> str:
    """``text`` (the resolved recipe as block YAML) with each line of a default key marked."""
    lines, section = [], None
    for line in text.splitlines():
        if line and not line.startswith(" "):
            section = line.split(":", 1)[0]
        elif section and line.startswith("  ") and not line.startswith("   ") and ":" in line:
            key = line.strip().split(":", 1)[0]
            if key in defaults.get(section, {}):
                line += MARK
        lines.append(line)
    return "\n".join(lines) + "\n"
