"""The vision tower of a vision-language model (``model.task: image_text_to_text``): found by module name, frozen
unless ``model.train_vision_tower``, and kept out of LoRA's targets, so by default only the language model adapts."""

from __future__ import annotations

import re

from hf_tune.catalog.tasks import task_of
from hf_tune.recipe.schema import Recipe

# The vision encoders and image projectors of transformers' VLMs: Idefics3 / SmolVLM (vision_model, connector),
# LLaVA / Gemma 3 / PaliGemma (vision_tower, multi_modal_projector), Qwen2-VL / Qwen2.5-VL (visual), Mllama.
VISION_PARTS = {"vision_model", "vision_tower", "visual", "vision_encoder", "connector", "multi_modal_projector",
                "mm_projector"}


def vision_modules(model) -> list[str]:
    """Dotted names of the outermost modules that are the vision tower or its projector."""
    found: list[str] = []
    for name, _ in model.named_modules():
        if name.rsplit(".", 1)[-1] in VISION_PARTS and not any(name.startswith(f"{top}.") for top in found):
            found.append(name)
    return found


def freezes_vision(recipe: Recipe) -> bool:
    return task_of(recipe.model.task).vision_language and not recipe.model.train_vision_tower


def freeze_vision_tower(model) -> int:
    """Stop gradients into the vision tower and projector; returns the number of parameters frozen."""
    frozen = 0
    for name in vision_modules(model):
        for param in model.get_submodule(name).parameters():
            param.requires_grad_(False)
            frozen += param.numel()
    return frozen


def vision_lora_exclusions(model, recipe: Recipe, lora: dict) -> dict:
    """The ``lora`` section with the vision modules in ``exclude_modules`` when the tower stays frozen (a section that
    names its own ``exclude_modules`` is kept as written)."""
    lora = dict(lora)
    names = vision_modules(model)
    if freezes_vision(recipe) and names and "exclude_modules" not in lora:
        lora["exclude_modules"] = rf"(?:{'|'.join(re.escape(n) for n in names)})(?:\..*)?"
    return lora
