"""What a run will use where the recipe is silent and hf_tune decides (not upstream's default): the attention, the
padding-free batches, where to resume, ``use_cpu``, bf16 on a GPU, one pack per step, the schedule. ``hf-tune
validate`` prints them in place, each marked ``# hf_tune's default``. Reads the config (hf_tune's copy offline), no
weight."""

from __future__ import annotations

from typing import Any

import yaml

from hf_tune.assembly.decisions import decide
from hf_tune.assembly.memory_fit import refuse_unfit
from hf_tune.catalog.methods import method_of
from hf_tune.catalog.tasks import task_of
from hf_tune.recipe.schema import Recipe
from hf_tune.records.resolved_recipe import resolved_recipe_dict
from hf_tune.redaction import redact_secrets
from hf_tune.training_args import build_training_arguments, training_kwargs

MARK = "  # hf_tune's default"


def hf_tune_defaults(recipe: Recipe) -> dict[str, dict[str, Any]]:
    """{section: {key: value}} of the values hf_tune fills in for this recipe on this machine."""
    args = build_training_arguments(recipe)
    decisions = decide(recipe, args)  # the rules the build applies, fitted to this machine
    refuse_unfit(decisions)  # a recipe key that keeps the run from fitting: refused, as training would
    training = {key: value for key, value in training_kwargs(recipe).items()
                if key not in recipe.training and key not in ("run_name", "project")}  # those two: tracking's
    if "resume_from_checkpoint" not in recipe.training:  # a recipe's own `auto` is the recipe's, not marked
        training["resume_from_checkpoint"] = decisions.resume_from_checkpoint
    if "enable_jit_checkpoint" not in recipe.training:
        training["enable_jit_checkpoint"] = decisions.save_on_signal  # upstream's default: off
    if (decisions.memory or {}).get("changed"):  # the fit to this machine's memory
        if decisions.checkpointing and "activation_checkpointing" not in recipe.training:
            training.update(activation_checkpointing=True,
                            activation_checkpointing_kwargs=decisions.checkpointing_kwargs)
        if decisions.per_device_train_batch_size != args.per_device_train_batch_size:
            training.update(per_device_train_batch_size=decisions.per_device_train_batch_size,
                            gradient_accumulation_steps=decisions.gradient_accumulation_steps)
    defaults = {"training": training}
    if not method_of(recipe.method).uses_trl and task_of(recipe.model.task).causal:
        if recipe.model.attn_implementation is None:
            defaults["model"] = {"attn_implementation": decisions.attention}
        if recipe.data.padding_free is None:
            defaults["data"] = {"padding_free": decisions.padding_free}
    return defaults


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


def effective_recipe(recipe: Recipe) -> str:
    """The resolved recipe as YAML, secrets redacted, with what hf_tune decides where the recipe is silent filled in
    and each such line marked as hf_tune's default (what ``hf-tune validate`` prints)."""
    resolved, defaults = resolved_recipe_dict(recipe), hf_tune_defaults(recipe)
    for section, values in defaults.items():  # what the run will use, each marked as hf_tune's default
        target = resolved.setdefault(section, {})
        target.update({key: value for key, value in values.items() if target.get(key) is None})
    return mark_defaults(yaml.safe_dump(redact_secrets(resolved), sort_keys=False), defaults)
