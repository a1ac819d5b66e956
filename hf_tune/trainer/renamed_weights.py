"""A resume whose checkpoint names the weights otherwise than the model does. transformers 5 saves some models (ViT:
``vit.encoder.layer.N.attention.attention.query``) under their legacy names, which ``from_pretrained`` converts back
(``vit.layers.N.attention.q_proj``), but ``Trainer``'s resume loads ``model.safetensors`` with
``load_state_dict(strict=False)``, which skips every renamed tensor: the encoder silently restarts from the base
weights (found by ``tests/test_images.py``). This callback reloads such a checkpoint through ``from_pretrained``."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from transformers import TrainerCallback

logger = logging.getLogger(__name__)


def saved_weight_names(checkpoint: Path) -> set[str] | None:
    """The tensor names of a checkpoint's full model (one file or a sharded index), read from headers only."""
    index = checkpoint / "model.safetensors.index.json"
    if index.is_file():
        return set(json.loads(index.read_text())["weight_map"])
    single = checkpoint / "model.safetensors"
    if not single.is_file():
        return None  # an adapter, or a format Trainer loads otherwise
    from safetensors import safe_open

    with safe_open(str(single), "pt") as f:
        return set(f.keys())


class ReloadRenamedWeights(TrainerCallback):
    """At the start of a resumed run, a checkpoint whose names are not the model's is loaded again by
    ``from_pretrained`` (which knows the model's renamings) and copied into the model, in place (the optimizer keeps
    its parameters)."""

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        checkpoint = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if model is None or state.global_step == 0 or hasattr(model, "peft_config") or not checkpoint.is_dir():
            return
        names = saved_weight_names(checkpoint)
        own = set(model.state_dict())
        if names is None or names == own or not names - own:
            return
        import torch

        reloaded = type(model).from_pretrained(checkpoint, dtype=next(model.parameters()).dtype)
        with torch.no_grad():
            missing, unexpected = model.load_state_dict(reloaded.state_dict(), strict=False)
        logger.info("resume: %s names %d tensors otherwise than the model; reloaded through from_pretrained",
                    checkpoint.name, len(names - own))
        if missing or unexpected:
            raise RuntimeError(f"resume: {checkpoint} does not match the model (missing {sorted(missing)[:5]}, "
                               f"unexpected {sorted(unexpected)[:5]})")
