"""hf_tune: one YAML recipe -> Hugging Face ``TrainingArguments``, model, tokenizer, datasets -> ``Trainer``.

Notebook API, each step callable alone::

    recipe = load_recipe("recipes/llm_lora.yaml", ["training.max_steps=20"])
    run = build_run(recipe)    # TrainingArguments, tokenizer, model, datasets and trainer, built in order
    run.trainer.train()        # or simply: train(recipe), which also fills the run folder
    search(load_recipe("recipes/llm_lora_search.yaml"))   # hyperparameter search from the recipe's search section
    model = load_model("runs/llm_lora")   # a run folder's trained model: an adapter on its base, wherever it is

``import hf_tune`` is light: each name is imported when first used.
"""

from __future__ import annotations

import importlib
import logging
import os
import warnings

# MKL's float32 kernels on CPUs with AVX-512 may sum in another order when a buffer sits at another address, so a
# resumed process (another allocation layout) drifted 1e-6 from the run it continues (a ZeRO-2 run killed and resumed
# on a Xeon with AMX). Conditional numerical reproducibility makes the sums depend on the data only. Set before torch
# runs its first matmul; a value of the user's own is kept.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")


class _NotAboutTheRun(logging.Filter):
    """Drops a library's message that says nothing about the user's run, printed by every command or run that imports
    it: bitsandbytes' that the optional ``kernels`` package is missing (on any CPU with AVX512-BF16, at PEFT's import;
    bitsandbytes then runs its own CPU kernel, which tests/test_qlora.py trains on); DeepSpeed's "Setting accelerator
    to CPU" (transformers imports DeepSpeed wherever it is installed, so every CPU run printed it); lm-eval's three
    about how it was called when hf_tune scores the model in memory (``hf_tune.evaluation.harness``: an ``HFLM`` over
    a loaded model, one process, the shipped tasks, which take no ``--metadata``)."""

    def __init__(self, *fragments: str):
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(fragment in str(record.msg) for fragment in self.fragments)


logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(
    _NotAboutTheRun("Failed to load CPU gemm_4bit_forward from kernels-community"))
logging.getLogger("DeepSpeed").addFilter(_NotAboutTheRun("Setting accelerator to CPU"))
logging.getLogger("lm_eval.models.huggingface").addFilter(_NotAboutTheRun(
    "`pretrained` model kwarg is not of type `str`", "Passed an already-initialized model through `pretrained`"))
logging.getLogger("lm_eval.api.task").addFilter(_NotAboutTheRun("Custom kwargs can be passed to `--metadata`"))
# PEFT asks transformers' deprecated is_gradient_checkpointing when it wraps a model: a warning about PEFT's call,
# printed by every LoRA run and every adapter load
warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)

from hf_tune.search import search  # noqa: F401  bound here, so that hf_tune.search stays the function (see hf_tune/search)

__version__ = "0.1.0"
_EXPORTS = {
    "HfTuneError": "hf_tune.errors",
    "RecipeError": "hf_tune.errors",
    "Recipe": "hf_tune.recipe.schema",
    "load_recipe": "hf_tune.build.loading",
    "build_run": "hf_tune.build.run_build",
    "Run": "hf_tune.build.run_build",
    "build_training_arguments": "hf_tune.training_args",
    "build_model_and_tokenizer": "hf_tune.build.run_build",
    "build_datasets": "hf_tune.data",
    "build_trainer": "hf_tune.build.run_build",
    "HfTuneTrainer": "hf_tune.trainer.hooks",
    "train": "hf_tune.workflows.train",
    "load_model": "hf_tune.lifecycle.run_reader",
}
__all__ = sorted([*_EXPORTS, "search"])


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'hf_tune' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
