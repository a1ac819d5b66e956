"""Models: loading (local folders, Hub ids, GGUF, embedded packages), the attention choice, LoRA wrapping."""

from hf_tune.model.loading import build_model, build_tokenizer, model_class

__all__ = ["build_model", "build_tokenizer", "model_class"]
