"""Checks across sections, made when the recipe loads: contradictions that would otherwise surface hours later."""

from __future__ import annotations

from hf_tune.ds_config import deepspeed_config_path, load_deepspeed_config
from hf_tune.errors import RecipeError
from hf_tune.recipe.loading import Recipe

COSINE_SCHEDULES = ("cosine", "cosine_with_min_lr")


def check_consistency(recipe: Recipe, optim_given: bool) -> None:
    training, data = recipe.training, recipe.data
    evaluating = str(training.get("eval_strategy", "no")) != "no"
    if evaluating and data.eval is None and data.eval_split is None:
        raise RecipeError("training.eval_strategy", f"is {training['eval_strategy']!r} but the recipe has no eval data",
                          fix="set data.eval (a file) or data.eval_split (e.g. 0.05), or training.eval_strategy: 'no'")
    classifying = recipe.model.task == "sequence_classification"
    if classifying != (data.format == "classification"):
        raise RecipeError("data.format", f"format {data.format!r} does not fit model.task {recipe.model.task!r}",
                          fix="use data.format: classification with model.task: sequence_classification, "
                          "and a text format (chat, instruction, prompt_completion, text) with causal_lm")
    if recipe.evaluation.metrics and not classifying:
        raise RecipeError("evaluation.metrics", "metrics are computed for sequence_classification; a causal LM's "
                          "evaluation reports eval_loss and eval_perplexity", fix="remove evaluation.metrics")
    from hf_tune.evaluation import metric_path

    for name in recipe.evaluation.metrics:
        metric_path(name)
    _check_early_stopping(recipe, evaluating)
    _check_batching(recipe, classifying)
    _check_deepspeed(recipe, optim_given)
    _check_fsdp(recipe)
    _check_push(recipe)
    if recipe.search is not None:
        _check_search(recipe, evaluating)


def _check_batching(recipe: Recipe, classifying: bool) -> None:
    data, training = recipe.data, recipe.training
    for key in ("padding_free", "batch_tokens"):
        if classifying and getattr(data, key):
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


SEARCHABLE_SECTIONS = ("training", "lora", "optim", "model")


def _check_search(recipe: Recipe, evaluating: bool) -> None:
    """Every space key is a valid recipe key (checked by validating the recipe with a sample value), every metric is
    one the run produces, and the pruner has evaluations to prune on."""
    from hf_tune.errors import HfTuneError
    from hf_tune.recipe.loading import apply_values, validate_recipe

    search = recipe.search
    base = {k: v for k, v in recipe.to_dict().items() if k != "search"}
    for key, dist in search.space.items():
        path = f"search.space.{key}"
        section = key.split(".")[0]
        if "." not in key or section not in SEARCHABLE_SECTIONS:
            raise RecipeError(path, f"cannot be searched: keys of {', '.join(SEARCHABLE_SECTIONS)} can "
                              "(data keys would need the data tokenized again for every trial)")
        if section == "lora" and recipe.lora is None:
            raise RecipeError(path, "the recipe has no lora section", fix="add a lora section to search its keys")
        sample = dist.choices[0] if dist.type == "categorical" else int(dist.low) if dist.type == "int" else dist.low
        try:
            validate_recipe(apply_values(base, {key: sample}))
        except HfTuneError as err:
            raise RecipeError(path, str(err).removeprefix(f"{key}: ")) from None
        if search.sampler == "grid" and dist.type == "float" and dist.step is None:
            raise RecipeError(path, "the grid sampler needs a finite grid", fix="give it a step, or make it categorical")
    metrics = search_metrics(search)
    produced = {"eval_loss", "trainable_params", *(f"eval_{m}" for m in recipe.evaluation.metrics)}
    if recipe.model.task == "causal_lm":
        produced.add("eval_perplexity")
    for metric in metrics:
        if metric not in produced:
            raise RecipeError("search.metric", f"{metric!r} is never produced by this recipe",
                              fix=f"use one of {sorted(produced)}")
    if isinstance(search.directions, list) and len(search.directions) != len(metrics):
        raise RecipeError("search.directions", f"has {len(search.directions)} entries for {len(metrics)} metrics")
    if recipe.data.eval is None and recipe.data.eval_split is None:
        raise RecipeError("search", "trials are compared on eval data, and the recipe has none",
                          fix="set data.eval or data.eval_split")
    if search.pruner != "none":
        if len(metrics) > 1:
            raise RecipeError("search.pruner", "Optuna cannot prune multi-objective studies", fix="set pruner: none")
        if not evaluating:
            raise RecipeError("search.pruner", "pruning needs evaluations during each trial",
                              fix="set training.eval_strategy: steps (and eval_steps), or search.pruner: none")


def search_metrics(search) -> list[str]:
    return search.metric if isinstance(search.metric, list) else [search.metric]


def _check_push(recipe: Recipe) -> None:
    """A push at the end of hours of training must not be the first contact with the Hub."""
    if not recipe.training.get("push_to_hub"):
        return
    from huggingface_hub import constants, get_token

    from hf_tune.hub import hub_is_reachable

    if not get_token():
        raise RecipeError("training.push_to_hub", "asks for a push, but no Hugging Face token is configured",
                          fix="export HF_TOKEN=... (or `hf auth login`), or set training.push_to_hub: false and push "
                          "later with `hf-tune push RUN_DIR --repo-id OWNER/NAME`")
    if not hub_is_reachable():
        raise RecipeError("training.push_to_hub", f"asks for a push, but the Hub ({constants.ENDPOINT}) cannot be "
                          "reached (offline, or HF_HUB_OFFLINE is set)",
                          fix="set training.push_to_hub: false and push later with `hf-tune push RUN_DIR --repo-id "
                          "OWNER/NAME` from a machine online")


def _check_early_stopping(recipe: Recipe, evaluating: bool) -> None:
    training, evaluation = recipe.training, recipe.evaluation
    best = training.get("metric_for_best_model")
    if best:
        name = best.removeprefix("eval_")
        if name != "loss" and name not in [m.removesuffix(".py").rsplit("/", 1)[-1] for m in evaluation.metrics]:
            raise RecipeError("training.metric_for_best_model", f"{best!r} is not computed at evaluation",
                              fix=f"add {name!r} to evaluation.metrics, or use 'loss'")
    if evaluation.early_stopping_patience is None:
        return
    if not (evaluating and best and training.get("load_best_model_at_end")):
        raise RecipeError("evaluation.early_stopping_patience", "early stopping needs periodic evaluation and a metric",
                          fix="set training.eval_strategy (steps or epoch), training.metric_for_best_model, "
                          "training.load_best_model_at_end: true (and greater_is_better for metrics such as accuracy)")


# DeepSpeed key -> (TrainingArguments key, its default): a non-"auto" DeepSpeed value must agree with the recipe
_DS_MIRRORS = {
    "train_micro_batch_size_per_gpu": ("per_device_train_batch_size", 8),
    "gradient_accumulation_steps": ("gradient_accumulation_steps", 1),
    "gradient_clipping": ("max_grad_norm", 1.0),
    "bf16.enabled": ("bf16", False),
    "fp16.enabled": ("fp16", False),
}


def _check_fsdp(recipe: Recipe) -> None:
    """``training.fsdp_config.transformer_layer_cls_to_wrap`` must name block classes of the recipe's model (a typo
    otherwise fails on the cluster, after the model has loaded)."""
    training = recipe.training
    config = training.get("fsdp_config") or {}
    if not training.get("fsdp") or not isinstance(config, dict):
        return
    if training.get("deepspeed"):
        raise RecipeError("training.fsdp", "is set together with training.deepspeed", fix="choose one of them")
    key = next((k for k in ("transformer_layer_cls_to_wrap", "fsdp_transformer_layer_cls_to_wrap") if k in config),
               None)
    if key is None:
        return
    import sys

    from torch import nn

    from hf_tune.modeling import model_class

    cls = model_class(recipe)
    module = sys.modules[cls.__module__]
    blocks = {name for name, obj in vars(module).items() if isinstance(obj, type) and issubclass(obj, nn.Module)}
    wanted = config[key] if isinstance(config[key], list) else [config[key]]
    for name in wanted:
        if name not in blocks:
            from hf_tune.recipe.upstream import did_you_mean

            default = getattr(cls, "_no_split_modules", None) or sorted(blocks)
            raise RecipeError(f"training.fsdp_config.{key}", f"{name!r} is not a module class of {cls.__name__}",
                              fix=did_you_mean(name, sorted(blocks)) or f"use {default} (or remove the key: the "
                              "model's own _no_split_modules are wrapped by default)")


def _check_deepspeed(recipe: Recipe, optim_given: bool) -> None:
    config = recipe.training.get("deepspeed")
    if not config:
        return
    name = deepspeed_config_path(config).name if isinstance(config, str) else "the DeepSpeed config"
    config = load_deepspeed_config(config)  # the recipe keeps the short name or path the user wrote
    stage = config.get("zero_optimization", {}).get("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise RecipeError("training.deepspeed", f"{name}: unknown ZeRO stage {stage!r}", fix="use 0, 1, 2 or 3")
    for ds_key, (key, default) in _DS_MIRRORS.items():
        node = config
        for part in ds_key.split("."):
            node = node.get(part, "auto") if isinstance(node, dict) else "auto"
        wanted = recipe.training.get(key, default)
        if node != "auto" and node != wanted:
            raise RecipeError("training.deepspeed", f"{name} sets {ds_key}={node!r} but training.{key} is {wanted!r}",
                              fix=f'set {ds_key} to "auto" in the JSON (Trainer fills it from training.{key}), '
                              "or make the two equal")
    if optim_given and "optimizer" in config:
        raise RecipeError("training.deepspeed", "the DeepSpeed config has an 'optimizer' block, which replaces the "
                          "optimizer and so silently drops the optim section (layer-wise LR decay, no-decay groups)",
                          fix="remove the 'optimizer' block from the DeepSpeed JSON: Trainer then builds the "
                          "optimizer from training.optim and hf_tune's groups, and DeepSpeed steps it")
    if optim_given and "scheduler" in config:
        raise RecipeError("training.deepspeed", "the DeepSpeed config has a 'scheduler' block, which replaces the "
                          "warmup-cosine schedule", fix="remove the 'scheduler' block from the DeepSpeed JSON")


def resolve_schedule(recipe: Recipe) -> None:
    """Default schedule: linear warmup, then cosine down to ``optim.min_lr_ratio`` x each group's peak LR.

    That is upstream's ``cosine_with_min_lr`` with ``min_lr_rate``: a ratio, so each LLRD group keeps its own floor.
    Written into ``training`` so the resolved recipe shows it.
    """
    training, ratio = recipe.training, recipe.optim.min_lr_ratio
    kind = str(training.get("lr_scheduler_type", "cosine_with_min_lr"))
    if kind not in COSINE_SCHEDULES:
        if ratio:
            raise RecipeError("optim.min_lr_ratio", f"is a floor for the cosine schedule, but "
                              f"training.lr_scheduler_type is {kind!r}", fix="remove optim.min_lr_ratio, or use cosine")
        return
    kwargs = dict(training.get("lr_scheduler_kwargs") or {})
    if "min_lr" in kwargs or ("min_lr_rate" in kwargs and kwargs["min_lr_rate"] != ratio and ratio):
        raise RecipeError("training.lr_scheduler_kwargs", "sets the floor of the schedule; so does optim.min_lr_ratio",
                          fix="set only optim.min_lr_ratio (a ratio of each group's peak LR)")
    kwargs["min_lr_rate"] = kwargs.get("min_lr_rate", ratio)
    training["lr_scheduler_type"], training["lr_scheduler_kwargs"] = "cosine_with_min_lr", kwargs
