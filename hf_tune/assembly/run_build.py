"""One build path: recipe -> ``Run`` (training arguments, tokenizer, data, model, trainer), used by ``train``,
``plan``, ``cv`` and ``search`` alike, so they cannot drift apart. The trainer builders live here too, and
``attach_callbacks`` is the one place that decides and attaches a run's callbacks.

The order matters: the training arguments come first, built once (under a CPU DeepSpeed launch they start the
process group that ZeRO-3's model loading needs) and the launch is checked before anything heavy; the data is loaded
once, by the main process first, and gives the class names to the model; the run's decisions are taken before any
weight loads (on the main process, for every rank) and fitted to the machine's memory (where the fit changes the
recipe, the arguments are built again from it);
the seed is set right before the model is built, so its freshly initialised weights (classification heads, LoRA)
are the same in every run with that seed.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

from transformers import TrainerCallback, TrainingArguments, set_seed

from hf_tune.assembly.decisions import RunDecisions, decide, fall_back, fitted_recipe, router_loss_coefficient
from hf_tune.assembly.memory_fit import pack_padding_ratio, refuse_unfit
from hf_tune.catalog.agents import (
    ENVIRONMENT_COLUMN,
    check_environment_column,
    check_tool_template,
    trainer_agent_kwargs,
)
from hf_tune.catalog.methods import method_of
from hf_tune.catalog.rewards import build_reward_funcs
from hf_tune.catalog.tasks import task_of
from hf_tune.data import TrainingData, build_collator, build_training_data, causal_lm_loss, data_seed, dataset_labels
from hf_tune.data.preference import load_method_data
from hf_tune.errors import RecipeError, stage_errors
from hf_tune.evaluation.downstream import build_downstream_scores, build_sample_callbacks
from hf_tune.evaluation.trainer_metrics import build_callbacks, build_compute_metrics
from hf_tune.model import build_model, build_tokenizer
from hf_tune.model.attention import loaded_attn_implementation, runs_examples_apart
from hf_tune.model.chunked_head import chunked_loss_head, default_chunked_loss_head, log_chunked_loss_off
from hf_tune.model.loading import model_class
from hf_tune.model.loss import ChunkedCausalLMLoss, RouterBalancedLoss
from hf_tune.optim.resume import RecipeHyperparameters
from hf_tune.recipe.schema import Recipe
from hf_tune.recipe.upstream import blame_key
from hf_tune.records.tracking import RecipeToTrackers
from hf_tune.runtime.distributed import check_distributed, decided_on_main, fit_cpu_threads
from hf_tune.trainer.checkpoints import CheckpointMarker
from hf_tune.trainer.hooks import HfTuneTrainer, method_trainer_class
from hf_tune.trainer.loss_guard import NonFiniteLossGuard
from hf_tune.trainer.mirror import CheckpointMirror
from hf_tune.trainer.monitors import Monitors
from hf_tune.trainer.preemption import SaveOnSignal, saves_on_signal
from hf_tune.trainer.renamed_weights import ReloadRenamedWeights
from hf_tune.trainer.rollback import StepSkips
from hf_tune.trainer.throughput import Throughput
from hf_tune.trainer.world_size import BatchShape
from hf_tune.training_args import build_training_arguments

logger = logging.getLogger("hf_tune")


def build_data(recipe: Recipe, tokenizer, args: TrainingArguments) -> TrainingData:
    """The run's data as its method reads it: tokenized (and packed) for sft, TRL's layouts for the others."""
    if method_of(recipe.method).uses_trl:
        return build_method_data(recipe, args)
    return build_training_data(recipe, tokenizer, args)


def build_method_data(recipe: Recipe, args: TrainingArguments) -> TrainingData:
    """A TRL method's examples in TRL's layout (its trainer tokenizes them), checked row by row."""
    with args.main_process_first(desc="reading datasets"):
        train, evaluation = load_method_data(recipe.data, recipe.method, data_seed(recipe), recipe.rewards)
    check_environment_column(recipe.agent, train.column_names, lambda: train[ENVIRONMENT_COLUMN], "data.train")
    return TrainingData(train, evaluation, labels=None)


def build_model_and_tokenizer(recipe: Recipe):
    """(model, tokenizer) alone, for a notebook: a classification model gets its class names from the training data
    (``build_run`` reads them once, with the data it builds)."""
    tokenizer = build_tokenizer(recipe)
    labels = dataset_labels(recipe) if task_of(recipe.model.task).class_labels else None
    decisions = decide(recipe, build_training_arguments(recipe), fit=False)
    return build_model(recipe, tokenizer, labels, attention=decisions.attention), tokenizer


@dataclasses.dataclass
class Run:
    recipe: Recipe
    args: TrainingArguments
    tokenizer: Any
    data: TrainingData
    model: Any | None
    trainer: HfTuneTrainer | None = None
    decisions: RunDecisions | None = None  # taken before the model loaded; a builder's fallback replaces a field

    def fall_back(self, name: str, value, why: str) -> None:
        """A builder could not run the decision ``name`` on the real model: ``value`` runs instead, for ``why``."""
        self.decisions = fall_back(self.decisions, name, value, why)


def build_run(recipe: Recipe, args: TrainingArguments | None = None, data: TrainingData | None = None,
              check_launch: bool = True, callbacks: Sequence[TrainerCallback] = ()) -> Run:
    """Everything a run needs, built in order. ``args``: the recipe's training arguments, when the caller needed
    them first (``train`` decides where to resume before building the rest); ``data``: datasets already built (the
    folds of cross-validation, a search's trials). ``check_launch=False``: build for a launch other than this one,
    without refusing this one. ``callbacks``: the caller's own (a profiler, a search trial's pruning or report),
    attached after hf_tune's (``attach_callbacks``)."""
    if args is None:
        args = build_training_arguments(recipe)
    if check_launch:
        check_distributed(args)
    fit_cpu_threads(args)
    tokenizer = build_tokenizer(recipe)
    if recipe.agent is not None:  # before the data and the model: a template with no tool format is refused here
        check_tool_template(tokenizer, recipe)
    method = method_of(recipe.method)
    if data is None:
        data = build_data(recipe, tokenizer, args)
    # decided once, before any weight loads, by the main process for every rank; a fit that cannot be met is refused
    decisions = decided_on_main(lambda: decide(recipe, args, padding_ratio=pack_padding_ratio(data.train)))
    refuse_unfit(decisions)
    for change in decisions.memory["changed"] if decisions.memory else []:
        logger.info("memory: %s, to fit the budget of %s", change, decisions.memory["budget"])
    fitted = fitted_recipe(decisions, recipe)
    if fitted is not recipe:  # rebuilt, not edited: TRL's configs derive fields from the batch (GRPO's generations)
        recipe, args = fitted, build_training_arguments(fitted)
    run = Run(recipe, args, tokenizer, data, model=None, decisions=decisions)
    set_seed(args.seed)
    # TRL's trainers wrap the model with the recipe's LoRA themselves: the reference is the adapter disabled
    run.model = build_model(dataclasses.replace(recipe, lora=None) if method.uses_trl else recipe, tokenizer,
                            data.labels, attention=decisions.attention, checkpointing=decisions.checkpointing,
                            fall_back=run.fall_back)
    with stage_errors(lambda message: blame_key("training", recipe.training, message), "building the Trainer"):
        run.trainer = build_trainer(recipe, run.model, tokenizer, data.train, data.eval, args, callbacks=callbacks,
                                    run=run)
    if method.uses_trl:  # the model TRL wrapped with the adapter, and the examples it tokenized
        run.model = run.trainer.model
        run.data = TrainingData(run.trainer.train_dataset, run.trainer.eval_dataset, labels=None)
    return run


def build_trainer(recipe: Recipe, model, tokenizer, train_dataset, eval_dataset, args: TrainingArguments,
                  callbacks: Sequence[TrainerCallback] = (), run: Run | None = None, **kwargs) -> HfTuneTrainer:
    """The trainer of a recipe, with every callback of the run (``attach_callbacks``; ``callbacks``: the caller's
    own, last). ``run``: the run being built, whose decisions the collator and the loss follow (without one, they
    decide by the same rules: the collator from the attention the model runs)."""
    if method_of(recipe.method).uses_trl:
        trainer = build_method_trainer(recipe, model, tokenizer, train_dataset, eval_dataset, args, run=run, **kwargs)
    else:
        task = task_of(recipe.model.task)
        attention = loaded_attn_implementation(model) if model is not None else None
        decided = run.decisions if run is not None else None
        trainer = HfTuneTrainer(
            model=model,
            args=args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=tokenizer,
            data_collator=build_collator(recipe, tokenizer, model_class(recipe, model), attn_implementation=attention,
                                         padding_free=decided.padding_free if decided else None),
            compute_loss_func=causal_loss(recipe, model, run) if task.causal else None,
            compute_metrics=build_compute_metrics(recipe.evaluation),
            optim=recipe.optim,
            causal=task.causal,
            **kwargs,
        )
    attach_callbacks(trainer, recipe, callbacks)
    return trainer


def causal_loss(recipe: Recipe, model, run: Run | None = None):
    """The causal LM loss: its chunked form through the model's LM head where the run decided it
    (``hf_tune.assembly.decisions``; without a run, as ``model.chunked_loss`` says, and where it is unset, where the
    head is frozen), proven on the model first (``hf_tune.model.chunked_head``): where the proof fails, a recipe that
    asked for it is refused and a default falls back to ``causal_lm_loss``, recorded. A mixture of experts adds its
    router's load-balancing loss (``RouterBalancedLoss``; the model returns it once ``output_router_logits`` is on)."""
    chunked = run.decisions.chunked_loss if run is not None else recipe.model.chunked_loss
    if not chunked or model is None:
        loss = causal_lm_loss
        if chunked is False and recipe.model.chunked_loss is None:
            log_chunked_loss_off(recipe)
        if chunked is None and model is not None:  # a notebook's trainer without a run: the default's own rule
            head = default_chunked_loss_head(recipe, model)
            loss = causal_lm_loss if head is None else ChunkedCausalLMLoss(head)
    elif recipe.model.chunked_loss:
        loss = ChunkedCausalLMLoss(chunked_loss_head(model))  # asked for: a failed proof is the recipe's error
    else:
        head = default_chunked_loss_head(recipe, model)
        if head is None and run is not None:
            run.fall_back("chunked_loss", False, "the head failed the chunked proof on the model (logged above)")
        loss = causal_lm_loss if head is None else ChunkedCausalLMLoss(head)
    coefficient = None if model is None else router_loss_coefficient(recipe, model.config)
    if coefficient:
        model.config.output_router_logits = True
        return RouterBalancedLoss(loss, coefficient)
    return loss


def build_method_trainer(recipe: Recipe, model, tokenizer, train_dataset, eval_dataset, args: TrainingArguments,
                         run: Run | None = None, **kwargs):
    """A TRL method's trainer, without callbacks. TRL wraps the model with the recipe's LoRA itself
    (``peft_config``), so that its reference is the base with the adapter disabled, and tokenizes the data in its
    own layouts. ``run``: the run being built, whose decision on padding-free pairs the trainer follows (DPO)."""
    method, task = method_of(recipe.method), task_of(recipe.model.task)
    extra = {}
    if method.flat_pairs and run is not None:  # a proof that fails falls back, unless the recipe asked for it
        extra.update(flat_pairs=run.decisions.padding_free, example_boundaries=runs_examples_apart(
            run.decisions.attention), fall_back=run.fall_back if recipe.training.get("padding_free") is None else None)
    if recipe.lora is not None:
        from peft import LoraConfig  # peft is loaded with a LoRA model only

        extra["peft_config"] = LoraConfig(task_type=task.peft_task_type, **recipe.lora)
    if method.rewarded:
        extra["reward_funcs"] = build_reward_funcs(recipe.rewards) or None  # None: the environments' own rewards
        extra.update(trainer_agent_kwargs(recipe.agent))
    if method.teacher and model is not None:
        extra["teacher_model"] = build_teacher(recipe, tokenizer, model)
    return method_trainer_class(method.name)(
        model=model, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset, processing_class=tokenizer,
        optim=recipe.optim, causal=task.causal, perplexity=False, **extra, **kwargs)


def build_teacher(recipe: Recipe, tokenizer, student):
    """Method distillation's teacher: loaded as the recipe's ``teacher`` section says (the ``model`` keys: a Hub id
    at a revision, a folder or ``embedded:``, its dtype), once, frozen and in eval mode. It must share the student's
    vocabulary: the divergence compares their whole next-token distributions."""
    try:
        teacher = build_model(dataclasses.replace(recipe, model=recipe.teacher, lora=None), tokenizer)
    except RecipeError as err:  # the teacher's keys, named as the recipe has them
        raise RecipeError(err.key.replace("model", "teacher", 1), err.problem, fix=err.fix) from None
    teacher.requires_grad_(False)
    teacher.eval()
    vocab = student.config.get_text_config().vocab_size, teacher.config.get_text_config().vocab_size
    if vocab[0] != vocab[1]:
        raise RecipeError("teacher.pretrained_model_name_or_path", f"{recipe.teacher.pretrained_model_name_or_path} "
                          f"has a vocabulary of {vocab[1]} tokens, the student {vocab[0]}: distillation compares their "
                          "next-token distributions token by token", fix="pick a teacher of the student's family "
                          "(the same tokenizer)")
    return teacher


def attach_callbacks(trainer, recipe: Recipe, extra: Sequence[TrainerCallback] = ()) -> Monitors:
    """Every callback hf_tune runs, decided and attached here and nowhere else, after Trainer's own (the flow and
    the trackers of ``report_to``): checkpoint markers, the recipe to the trackers, early stopping, the throughput
    counter and the NaN guard the trainer's hooks feed, the recipe's LRs on resume, then ``extra``: the caller's.
    Those the hooks feed are handed to the trainer as its ``monitors`` (and returned)."""
    monitors = build_monitors(recipe)
    callbacks = [
        CheckpointMarker(),
        monitors.mirror,  # after the marker: the mirror uploads complete checkpoints only
        monitors.step_skips,
        RecipeToTrackers(recipe),
        monitors.downstream,  # before early stopping; the scores: HfTuneMixin.evaluation_loop
        *build_sample_callbacks(recipe),
        *build_callbacks(recipe.evaluation),
        monitors.throughput,  # fed by HfTuneMixin.training_step
        *([SaveOnSignal()] if saves_on_signal(recipe) else []),  # before the guard: it may ask for a save
        monitors.loss_guard,  # after DefaultFlowCallback: it reads the step's log / save decision
        RecipeHyperparameters(trainer),  # a resume trains with the recipe's LRs (optim/resume.py)
        ReloadRenamedWeights(),  # a resume from a checkpoint saved under legacy names (trainer/renamed_weights.py)
        BatchShape(),  # each checkpoint records its batch shape, for a resume on another world size
        *extra,
    ]
    for callback in callbacks:
        if callback is not None:
            trainer.add_callback(callback)
    trainer.monitors = monitors
    return monitors


def build_monitors(recipe: Recipe) -> Monitors:
    """The callbacks a run's hooks feed: the NaN guard; the throughput counter (text tasks: it counts tokens); the
    ``resilience`` section's checkpoint mirror and rollback skips (which also feed each step's gradient norm to the
    guard); the downstream scores of ``evaluation.tasks``."""
    guard, task, section = NonFiniteLossGuard(), task_of(recipe.model.task), recipe.resilience
    return Monitors(
        loss_guard=guard,
        throughput=Throughput(causal=task.causal) if task.reads_text else None,
        step_skips=StepSkips(guard) if section.rollback_on_nonfinite else None,
        downstream=build_downstream_scores(recipe),
        mirror=CheckpointMirror(section.checkpoint_mirror) if section.checkpoint_mirror else None,
    )
