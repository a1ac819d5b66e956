"""What a run will use where the recipe is silent and hf_tune decides (not upstream's default): the attention, the
padding-free batches, where to resume, ``use_cpu``, bf16 on a GPU, one pack per step, the schedule. ``hf-tune
validate`` prints them in place, each marked ``# hf_tune's default``. Reads the config (hf_tune's copy offline), no weight."""

from __future__ import annotations

from typing import Any

from hf_tune.build.decisions import decide
from hf_tune.training_args import build_training_arguments, training_kwargs
from hf_tune.catalog.methods import method_of
from hf_tune.catalog.tasks import task_of
from hf_tune.recipe.schema import Recipe

MARK = "  # hf_tune's default"


def hf_tune_defaults(recipe: Recipe) -> dict[str, dict[str, Any]]:
    """{section: {key: value}} of the values hf_tune fills in for this recipe on this machine."""
    decisions = decide(recipe, build_training_arguments(recipe))  # the rules the build applies to the model
    training = {key: value for key, value in training_kwargs(recipe).items()
                if key not in recipe.training and key not in ("run_name", "project")}  # those two: tracking's
    if "resume_from_checkpoint" not in recipe.training:  # a recipe's own `auto` is the recipe's, not marked
        training["resume_from_checkpoint"] = decisions.resume_from_checkpoint
    if "enable_jit_checkpoint" not in recipe.training:
        training["enable_jit_checkpoint"] = decisions.save_on_signal  # upstream's default: off
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
