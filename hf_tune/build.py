"""One build path: recipe -> ``Run`` (training arguments, tokenizer, data, model, trainer), used by ``train``,
``plan``, ``cv`` and ``search`` alike, so they cannot drift apart.

The order matters: the training arguments come first (under a CPU DeepSpeed launch they start the process group
that ZeRO-3's model loading needs) and the launch is checked before anything heavy; the data is loaded once, by the
main process first, and gives the class names to the model; the seed is set right before the model is built, so its
freshly initialised weights (classification heads, LoRA) are the same in every run with that seed.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from transformers import TrainingArguments, set_seed

from hf_tune.data import TrainingData, build_training_data, data_seed, dataset_labels
from hf_tune.data.preference import load_method_data
from hf_tune.distributed import check_distributed, fit_cpu_threads
from hf_tune.errors import stage_errors
from hf_tune.methods import method_of
from hf_tune.model import build_model, build_tokenizer
from hf_tune.recipe.schema import Recipe
from hf_tune.recipe.upstream import blame_key
from hf_tune.tasks import task_of
from hf_tune.trainer import HfTuneTrainer, build_trainer
from hf_tune.training_args import build_training_arguments


def build_data(recipe: Recipe, tokenizer, args: TrainingArguments) -> TrainingData:
    """The run's data as its method reads it: tokenized (and packed) for sft, TRL's layouts for the others."""
    if method_of(recipe.method).uses_trl:
        return build_method_data(recipe, args)
    return build_training_data(recipe, tokenizer, args)


def build_method_data(recipe: Recipe, args: TrainingArguments) -> TrainingData:
    """A TRL method's examples in TRL's layout (its trainer tokenizes them), checked row by row."""
    with args.main_process_first(desc="reading datasets"):
        train, evaluation = load_method_data(recipe.data, recipe.method, data_seed(recipe), recipe.rewards)
    return TrainingData(train, evaluation, labels=None)


def build_model_and_tokenizer(recipe: Recipe):
    """(model, tokenizer) alone, for a notebook: a classification model gets its class names from the training data
    (``build_run`` reads them once, with the data it builds)."""
    tokenizer = build_tokenizer(recipe)
    labels = dataset_labels(recipe) if task_of(recipe.model.task).class_labels else None
    return build_model(recipe, tokenizer, labels), tokenizer


@dataclasses.dataclass
class Run:
    recipe: Recipe
    args: TrainingArguments
    tokenizer: Any
    data: TrainingData
    model: Any | None
    trainer: HfTuneTrainer | None = None


def build_run(recipe: Recipe, args: TrainingArguments | None = None, data: TrainingData | None = None,
              check_launch: bool = True) -> Run:
    """Everything a run needs, built in order. ``args``: the recipe's training arguments, when the caller needed
    them first (``train`` decides where to resume before building the rest); ``data``: datasets already built (the
    folds of cross-validation, a search's trials). ``check_launch=False``: build for a launch other than this one,
    without refusing this one."""
    if args is None:
        args = build_training_arguments(recipe)
    if check_launch:
        check_distributed(args)
    fit_cpu_threads(args)
    tokenizer = build_tokenizer(recipe)
    method = method_of(recipe.method)
    if data is None:
        data = build_data(recipe, tokenizer, args)
    run = Run(recipe, args, tokenizer, data, model=None)
    set_seed(args.seed)
    # TRL's trainers wrap the model with the recipe's LoRA themselves: the reference is the adapter disabled
    run.model = build_model(dataclasses.replace(recipe, lora=None) if method.uses_trl else recipe, tokenizer,
                            data.labels)
    with stage_errors(lambda message: blame_key("training", recipe.training, message), "building the Trainer"):
        run.trainer = build_trainer(recipe, run.model, tokenizer, data.train, data.eval, args)
    if method.uses_trl:  # the model TRL wrapped with the adapter, and the examples it tokenized
        run.model = run.trainer.model
        run.data = TrainingData(run.trainer.train_dataset, run.trainer.eval_dataset, labels=None)
    return run
