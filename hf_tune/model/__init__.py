"""Models: loading (local folders, Hub ids, GGUF, embedded packages), the attention choice, LoRA wrapping.

The package is light to import: ``build_model``, ``build_tokenizer`` and ``model_class`` load ``model.loading``
(transformers, PEFT) when first asked for, so a module that needs only ``model.embedded``'s table (the run folder's
lineage, read by ``compare``) imports no library."""

import importlib

__all__ = ["build_model", "build_tokenizer", "model_class"]


def __getattr__(name: str):
    if name in __all__:
        value = getattr(importlib.import_module("hf_tune.model.loading"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'hf_tune.model' has no attribute {name!r}")
