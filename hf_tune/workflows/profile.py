"""``hf-tune profile RECIPE``: a short run of only the profiled steps, into a folder of its own."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from hf_tune.assembly.run_build import build_run
from hf_tune.errors import HfTuneError
from hf_tune.recipe.schema import ProfileSection, Recipe
from hf_tune.trainer.profiling import StepProfiler, profile_dir


def profile_recipe(recipe: Recipe, out: str | Path | None = None) -> dict[str, Any]:
    """``hf-tune profile``: train only the profiled steps (wait + warmup + active) into ``out`` (default: the
    run folder's name + ``-profile``), with no tracker, checkpoint or evaluation, so the real run folder is left as
    it is. Returns the summary, with the folder under ``dir``."""
    section = recipe.profile or ProfileSection()
    out = Path(out) if out else recipe.output_dir.with_name(recipe.output_dir.name + "-profile")
    steps = section.wait + section.warmup + section.active
    training = {**recipe.training, "output_dir": str(out), "max_steps": steps, "report_to": "none",
                "save_strategy": "no", "eval_strategy": "no", "logging_steps": 1,
                "resume_from_checkpoint": None, "push_to_hub": False, "load_best_model_at_end": False}
    profiled = dataclasses.replace(recipe, training=training, profile=section)
    profiler = StepProfiler(section, profile_dir(out))
    build_run(profiled, callbacks=[profiler]).trainer.train()
    if profiler.summary is None:
        raise HfTuneError(f"profile: no profiled step was recorded in {steps} steps")
    return {**profiler.summary, "dir": str(profile_dir(out))}
