"""The ``resilience`` section: checkpoints mirrored to object storage, and a rollback instead of a stop on a
non-finite loss. Pure: the mirror URL is checked here (no credentials in it, its fsspec backend installed), nothing is
opened."""

from __future__ import annotations

import importlib.util

from pydantic import Field, field_validator

from hf_tune.errors import RecipeError
from hf_tune.recipe.section import Section
from hf_tune.redaction import url_has_credentials


class ResilienceSection(Section):
    """Survive lost machines and bad steps (hf_tune.trainer.mirror, hf_tune.trainer.rollback)."""

    checkpoint_mirror: str | None = Field(
        default=None, description="an fsspec URL (s3://bucket/prefix, gs://..., file:///shared/..., or a shared "
                                  "path): each complete checkpoint and the run folder's small files are uploaded "
                                  "there in the background, and a run whose output_dir holds no checkpoint resumes "
                                  "from the newest complete one there; credentials come from the environment "
                                  "(AWS_*, fsspec's config), never from the URL")
    rollback_on_nonfinite: int = Field(
        default=0, ge=0, description="a non-finite loss reloads the last complete checkpoint, skips the optimizer "
                                     "step whose batches gave it, and continues, up to this many times (0: the run "
                                     "stops with exit status 3); each rollback is logged and kept in run.json")

    @field_validator("checkpoint_mirror")
    @classmethod
    def _mirror_url(cls, url: str | None) -> str | None:
        if url is None:
            return None
        if url_has_credentials(url):  # a RecipeError passes through pydantic: the URL is not echoed back
            raise RecipeError("resilience.checkpoint_mirror", "holds credentials, which would be written into "
                              "recipe.yaml, run.json and every checkpoint's training_args.bin",
                              fix="give them through the environment (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, "
                                  "AWS_PROFILE, GOOGLE_APPLICATION_CREDENTIALS) or fsspec's config, and name only "
                                  "the bucket and prefix in the URL")
        protocol = url.split("://", 1)[0] if "://" in url else "file"
        module = _FSSPEC_BACKENDS.get(protocol)
        if module and importlib.util.find_spec(module) is None:
            raise ValueError(f"{protocol}:// needs the package {module}: pip install 'hf_tune[mirror]' (s3fs) or "
                             f"pip install {module}")
        return url


# fsspec's backends that live in packages of their own (the others ship with fsspec)
_FSSPEC_BACKENDS = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs"}


def check_resilience(recipe) -> None:
    """The section against the rest of the recipe (a ``Recipe``; called when the recipe loads)."""
    section = recipe.resilience
    if section.checkpoint_mirror and recipe.search is not None:
        raise RecipeError("resilience.checkpoint_mirror", "every trial of a search would upload its checkpoints to "
                          "the same mirror", fix="mirror single runs; leave it out of a search recipe")
    if section.rollback_on_nonfinite and recipe.training.get("deepspeed"):
        raise RecipeError("resilience.rollback_on_nonfinite", "is not supported under DeepSpeed (its engine steps "
                          "inside the backward pass that a skipped step leaves out)",
                          fix="leave resilience.rollback_on_nonfinite at 0 with training.deepspeed (DDP and a "
                              "single process support it)")
    if section.rollback_on_nonfinite and str(recipe.training.get("save_strategy", "steps")).lower() in ("no", "none"):
        raise RecipeError("resilience.rollback_on_nonfinite", "rolls back to the last complete checkpoint, and "
                          "training.save_strategy 'no' keeps none to roll back to",
                          fix="save checkpoints (training.save_strategy: steps, with training.save_steps), or leave "
                              "resilience.rollback_on_nonfinite out")
