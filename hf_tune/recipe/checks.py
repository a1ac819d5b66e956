"""Checks across sections, made when the recipe loads: contradictions that would otherwise surface hours later.
Pure: they read the recipe (and the DeepSpeed JSON it names) and change nothing."""

from __future__ import annotations

import importlib.util

from hf_tune.catalog.formats import format_names, format_of, formats_trained_by
from hf_tune.catalog.methods import METHODS, method_of
from hf_tune.catalog.rewards import reward_spec
from hf_tune.catalog.search_backends import SEARCH_BACKENDS
from hf_tune.catalog.tasks import task_of
from hf_tune.catalog.trackers import TRACKERS
from hf_tune.errors import RecipeError
from hf_tune.metrics import metric_path
from hf_tune.recipe.chunked_loss_checks import check_chunked_loss
from hf_tune.recipe.data_checks import check_sources
from hf_tune.recipe.evaluation_tasks import check_evaluation_tasks, is_task_metric, mistyped_task, shipped_tasks
from hf_tune.recipe.quantization import check_quantization, weight_sharding
from hf_tune.recipe.schedule_checks import check_training_steps
from hf_tune.recipe.schema import Recipe
from hf_tune.recipe.search_space import check_search_settings
from hf_tune.runtime.ds_config import check_deepspeed_config


def check_consistency(recipe: Recipe, optim_given: bool) -> None:
    training, data = recipe.training, recipe.data
    task = task_of(recipe.model.task)
    evaluating = str(training.get("eval_strategy", "no")) != "no"
    if evaluating and data.eval is None and data.eval_split is None:
        raise RecipeError("training.eval_strategy", f"is {training['eval_strategy']!r} but the recipe has no eval data",
                          fix="set data.eval (a file) or data.eval_split (e.g. 0.05), or training.eval_strategy: 'no'")
    if not method_of(recipe.method).uses_trl and data.format not in task.formats:
        raise RecipeError("data.format", f"format {data.format!r} does not fit model.task {recipe.model.task!r}",
                          fix="use data.format: " + "; ".join(f"{' or '.join(formats_trained_by(name))} with "
                                                              f"model.task: {name}" for name in method_of("sft").tasks))
    if recipe.evaluation.metrics and not task.recipe_metrics:
        raise RecipeError("evaluation.metrics", "metrics are computed for sequence_classification; a causal LM's "
                          "evaluation reports eval_loss and eval_perplexity", fix="remove evaluation.metrics")
    for name in recipe.evaluation.metrics:
        metric_path(name)
    check_evaluation_tasks(recipe, task.causal)
    _check_early_stopping(recipe, evaluating)
    check_training_steps(recipe)
    check_sources(recipe)
    _check_batching(recipe, task.causal)
    check_deepspeed_config(recipe.training, optim_given)
    _check_fsdp_with_deepspeed(recipe)
    _check_integrations_installed(recipe.training)
    check_quantization(recipe)
    check_chunked_loss(recipe)
    if recipe.optim.loraplus_lr_ratio is not None and recipe.lora is None:
        raise RecipeError("optim.loraplus_lr_ratio", "scales the LR of LoRA B matrices, and the recipe has no lora "
                          "section", fix="add a lora section, or remove optim.loraplus_lr_ratio")


# data keys of hf_tune's own SFT tokenization and batching; TRL's trainers tokenize and batch themselves
_SFT_DATA_KEYS = {"max_length": "set training.max_length (the method's config has its own)",
                  "batch_tokens": "remove it: TRL's trainers batch by example",
                  "padding_free": "set training.padding_free where the method's config has it, or remove it",
                  "streaming": "remove it: TRL's trainers read the whole dataset (and precompute on it)"}


def check_method(recipe: Recipe, raw: dict) -> None:
    """The method, its model head, its data format and its rewards agree (``raw``: the recipe as written, to tell a
    key the recipe sets from a default)."""
    method = method_of(recipe.method)
    given = f"method {method.name!r}"
    if recipe.model.task not in method.tasks:
        raise RecipeError("model.task", f"is {recipe.model.task!r}, but {given} trains a {' or '.join(method.tasks)} "
                          "model", fix="remove model.task (it follows the method), or choose another method")
    if recipe.data.format not in method.formats:
        raise RecipeError("data.format", f"{recipe.data.format!r} is not read by {given}",
                          fix=f"use data.format: {' or '.join(method.formats)} (docs/methods.md shows each layout)")
    if method.uses_trl:
        if isinstance(recipe.data.train, list):
            raise RecipeError("data.train", f"a mixture of sources is read by method 'sft'; {given} reads one source",
                              fix="give data.train one source (mix the files beforehand), or use method: sft")
        for key, fix in _SFT_DATA_KEYS.items():
            if (raw.get("data") or {}).get(key) not in (None, False):
                raise RecipeError(f"data.{key}", f"applies to method 'sft'; {given} runs TRL's trainer", fix=fix)
    sharded = weight_sharding(recipe) if method.flat_pairs and recipe.training.get("padding_free") else None
    if sharded:  # the flattened pairs are proven by a forward on the model before training: whole weights only
        raise RecipeError("training.padding_free", f"{given}'s pairs as one flattened row are proven on the model "
                          f"before training, and {sharded[1]} ({sharded[0]}) shards its weights over the ranks",
                          fix="remove training.padding_free (the pairs then run padded, as TRL runs them)")
    if method.rewarded and not recipe.rewards and recipe.agent is None:  # an environment may own its reward
        raise RecipeError("rewards", f"{given} needs at least one reward function",
                          fix="e.g. rewards: [{name: exact_answer, column: answer}]")
    if recipe.rewards and not method.rewarded:
        rewarded = [name for name, m in METHODS.items() if m.rewarded]
        raise RecipeError("rewards", f"only {_methods(rewarded)} use{'s' * (len(rewarded) == 1)} reward functions; "
                          f"{given} does not", fix=f"remove rewards, or set method: {' or '.join(rewarded)}")
    if method.teacher and recipe.teacher is None:
        raise RecipeError("teacher", f"{given} learns from a teacher model, and the recipe names none",
                          fix="add teacher: {pretrained_model_name_or_path: <a Hub id, a folder or embedded:NAME>}")
    if recipe.teacher is not None and not method.teacher:
        taught = [name for name, m in METHODS.items() if m.teacher]
        raise RecipeError("teacher", f"only {_methods(taught)} learn{'s' * (len(taught) == 1)} from a teacher; "
                          f"{given} does not", fix=f"remove teacher, or set method: {' or '.join(taught)}")
    for key, value in method.config_fixed:
        if recipe.training.get(key, value) != value:
            raise RecipeError(f"training.{key}", f"{given} runs {method.config.__name__} with {key} {value!r}, the "
                              f"recipe sets {recipe.training[key]!r}", fix=f"remove training.{key}")
    for index, entry in enumerate(recipe.rewards):
        reward_spec(entry, index)


def _check_batching(recipe: Recipe, causal: bool) -> None:
    data, training = recipe.data, recipe.training
    for key in ("padding_free", "batch_tokens"):
        if not causal and getattr(data, key):
            raise RecipeError(f"data.{key}", "applies to causal LM formats; a classification batch is padded",
                              fix=f"remove data.{key}")
    if data.batch_tokens is None:
        return
    if data.batch_tokens < data.max_length:
        raise RecipeError("data.batch_tokens", f"({data.batch_tokens}) is below data.max_length ({data.max_length}): "
                          "the longest examples would not fit a pack", fix="raise data.batch_tokens or lower "
                          "data.max_length")
    if training.get("train_sampling_strategy") == "group_by_length":
        raise RecipeError("training.train_sampling_strategy", "group_by_length would sort packs by their number of "
                          "examples; data.batch_tokens already groups examples by length",
                          fix="remove training.train_sampling_strategy (or data.batch_tokens)")


def check_search(recipe: Recipe) -> None:
    """Every metric is one the run produces, and the pruner has evaluations to prune on (the space's keys are
    checked by validating the recipe with a sample value, in ``recipe.validation``)."""
    search = recipe.search
    evaluating = str(recipe.training.get("eval_strategy", "no")) != "no"
    metrics = search_metrics(search)
    produced = set.intersection(*(_produced_metrics(recipe, name) for name in _searched_methods(recipe)))
    for metric in metrics:
        if metric not in produced and not is_task_metric(metric, recipe.evaluation.tasks):
            raise RecipeError("search.metric", f"{metric!r} is never produced by this recipe" + (
                              " under every searched method" if "method" in search.space else ""),
                              fix=f"use one of {sorted(produced)}")
    if isinstance(search.directions, list) and len(search.directions) != len(metrics):
        raise RecipeError("search.directions", f"has {len(search.directions)} entries for {len(metrics)} metrics")
    if search.cv is not None:
        _check_cross_validated_search(recipe)
    elif search.pruner == "wilcoxon":
        raise RecipeError("search.pruner", "wilcoxon pairs a trial's values with the best trial's, fold by fold: it "
                          "needs a cross-validated search", fix="set search.cv: 5 (k folds), or pruner median")
    elif recipe.data.eval is None and recipe.data.eval_split is None:
        raise RecipeError("search", "trials are compared on eval data, and the recipe has none",
                          fix="set data.eval or data.eval_split")
    check_search_settings(recipe)  # the space's structure, the backend and its scheduler (recipe.search_space)
    if search.pruner != "none" and SEARCH_BACKENDS[search.backend].prunes:
        if len(metrics) > 1:
            raise RecipeError("search.pruner", "Optuna cannot prune multi-objective studies", fix="set pruner: none")
        if not evaluating and search.pruner != "wilcoxon":
            raise RecipeError("search.pruner", "pruning needs evaluations during each trial",
                              fix="set training.eval_strategy: steps (and eval_steps), or search.pruner: none")


def _searched_methods(recipe: Recipe) -> list[str]:
    """The methods the trials run: the choices of ``search.space.method``, else the recipe's."""
    space = recipe.search.space
    return list(space["method"].choices) if "method" in space else [recipe.method]


def _produced_metrics(recipe: Recipe, method_name: str) -> set[str]:
    """What a run of this recipe under ``method_name`` reports: its evaluation's metrics and trainable_params."""
    method = method_of(method_name)
    evaluated = method.eval_metrics if method.uses_trl else task_of(recipe.model.task).eval_metrics
    return {"trainable_params", *evaluated, *(f"eval_{m}" for m in recipe.evaluation.metrics)}


def _check_cross_validated_search(recipe: Recipe) -> None:
    """search.cv: each trial trains k stratified folds of data.train on the Optuna backend; its steps are folds."""
    search = recipe.search
    if not SEARCH_BACKENDS[search.backend].cross_validates:
        raise RecipeError("search.cv", "a cross-validated search runs on the Optuna backend (Ray's schedulers act on "
                          "the evaluations of one training run)", fix="set search.backend: optuna, or remove search.cv")
    if not format_of(recipe.data.format).class_labels:
        raise RecipeError("search.cv", f"the folds are stratified by label, so they need data.format "
                          f"{' or '.join(format_names(class_labels=True))}, not {recipe.data.format!r}",
                          fix="remove search.cv (trials then evaluate on data.eval)")
    if search.pruner in ("median", "hyperband"):
        raise RecipeError("search.pruner", f"{search.pruner} compares trials at the same training step; with "
                          "search.cv a trial reports one value per fold", fix="set search.pruner: wilcoxon (the "
                          "default with search.cv: a paired test over the folds both trials ran) or none")


def search_metrics(search) -> list[str]:
    return search.metric if isinstance(search.metric, list) else [search.metric]


def _check_early_stopping(recipe: Recipe, evaluating: bool) -> None:
    training, evaluation = recipe.training, recipe.evaluation
    best = training.get("metric_for_best_model")
    if best:
        name = best.removeprefix("eval_")
        if (name != "loss" and name not in [m.removesuffix(".py").rsplit("/", 1)[-1] for m in evaluation.metrics]
                and not is_task_metric(name, evaluation.tasks)):
            _refuse_mistyped_task(best, evaluation.tasks)
            raise RecipeError("training.metric_for_best_model", f"{best!r} is not computed at evaluation",
                              fix=f"add {name!r} to evaluation.metrics, an lm-eval task to evaluation.tasks "
                              "(eval_<task>_<metric>), or use 'loss'")
    if evaluation.early_stopping_patience is None:
        return
    if not (evaluating and best and training.get("load_best_model_at_end")):
        raise RecipeError("evaluation.early_stopping_patience", "early stopping needs periodic evaluation and a metric",
                          fix="set training.eval_strategy (steps or epoch), training.metric_for_best_model, "
                          "training.load_best_model_at_end: true (and greater_is_better for metrics such as accuracy)")


def _refuse_mistyped_task(best: str, tasks: list[str]) -> None:
    """The metric names a task close to one of evaluation.tasks: the mistyped one is blamed (a task hf_tune ships is
    spelled right), not the metric as "not computed"."""
    mistyped = mistyped_task(best, tasks)
    if mistyped is None:
        return
    task, named = mistyped
    shipped = shipped_tasks()
    if task in shipped and named not in shipped:
        raise RecipeError("training.metric_for_best_model", f"{best!r} names the task {named!r}, and "
                          f"evaluation.tasks has {task!r}", fix=f"did you mean {best.replace(named, task, 1)!r}?")
    raise RecipeError("evaluation.tasks", f"{task!r} is not the task training.metric_for_best_model {best!r} scores "
                      f"({named!r})", fix=f"did you mean {named!r}?" if named in shipped else
                      "spell the task the same in evaluation.tasks and training.metric_for_best_model")


# Optional integrations: the package a recipe key needs, and how to install it (each tracker's from its entry).
INTEGRATIONS = {"deepspeed": ("deepspeed", "pip install 'hf_tune[deepspeed]'"),
                **{t.name: (t.package, f"pip install 'hf_tune[{t.extra}]'") for t in TRACKERS.values()},
                "liger": ("liger_kernel", "pip install liger-kernel (Triton kernels: on a CUDA GPU), or remove "
                          "training.use_liger_kernel")}


def _check_integrations_installed(training: dict) -> None:
    targets = training.get("report_to")
    wanted = [("training.report_to", t) for t in ([targets] if isinstance(targets, str) else list(targets or []))]
    if training.get("deepspeed"):
        wanted.append(("training.deepspeed", "deepspeed"))
    if training.get("use_liger_kernel"):
        wanted.append(("training.use_liger_kernel", "liger"))
    for key, name in wanted:
        if name in INTEGRATIONS and importlib.util.find_spec(INTEGRATIONS[name][0]) is None:
            raise RecipeError(key, f"needs the {INTEGRATIONS[name][0]} package, which is not installed",
                              fix=INTEGRATIONS[name][1])


def _check_fsdp_with_deepspeed(recipe: Recipe) -> None:
    if recipe.training.get("fsdp") and recipe.training.get("deepspeed"):
        raise RecipeError("training.fsdp", "is set together with training.deepspeed", fix="choose one of them")


def _methods(names: list[str]) -> str:
    """'method grpo', 'methods grpo and rloo': the methods a key belongs to, for an error."""
    listed = f"{', '.join(names[:-1])} and {names[-1]}" if len(names) > 1 else names[0]
    return f"method{'s' * (len(names) > 1)} {listed}"
