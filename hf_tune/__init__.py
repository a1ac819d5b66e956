"""hf_tune: one YAML recipe -> Hugging Face ``TrainingArguments``, model, tokenizer, datasets -> ``Trainer``.

Notebook API, each step callable alone::

    recipe = load_recipe("recipes/llm_lora.yaml", ["training.max_steps=20"])
    run = build_run(recipe)    # TrainingArguments, tokenizer, model, datasets and trainer, built in order
    run.trainer.train()        # or simply: train(recipe), which also fills the run folder
    search(load_recipe("recipes/llm_lora_search.yaml"))   # hyperparameter search from the recipe's search section
    model = load_model("runs/llm_lora")   # a run folder's trained model: an adapter on its base, wherever it is

``import hf_tune`` is light and changes nothing in the process: each name is imported when first used, and the
process-wide settings (``hf_tune.runtime.process.settle_process``) are made by the entry points and ``train``.
"""

from __future__ import annotations

import importlib

from hf_tune.search import search  # noqa: F401  bound here, so that hf_tune.search stays the function (see hf_tune/search)

__version__ = "0.1.0"
_EXPORTS = {
    "HfTuneError": "hf_tune.errors",
    "RecipeError": "hf_tune.errors",
    "Recipe": "hf_tune.recipe.schema",
    "load_recipe": "hf_tune.assembly.loading",
    "build_run": "hf_tune.assembly.run_build",
    "Run": "hf_tune.assembly.run_build",
    "build_training_arguments": "hf_tune.training_args",
    "build_model_and_tokenizer": "hf_tune.assembly.run_build",
    "build_datasets": "hf_tune.data",
    "build_trainer": "hf_tune.assembly.run_build",
    "HfTuneTrainer": "hf_tune.trainer.hooks",
    "train": "hf_tune.workflows.train",
    "load_model": "hf_tune.records.run_reader",
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
