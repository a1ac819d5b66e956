"""``hf-tune plan``: batch sizes, step counts, optimizer groups and the LR schedule of a recipe, without training."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import torch
from transformers import get_scheduler

from hf_tune import run_folder
from hf_tune.assembly.decisions import decide
from hf_tune.assembly.memory_fit import estimate_peak, pack_padding_ratio
from hf_tune.assembly.run_build import build_method_data
from hf_tune.catalog.agents import offered_tool_names
from hf_tune.catalog.formats import format_of
from hf_tune.catalog.methods import method_of
from hf_tune.catalog.tasks import task_of
from hf_tune.data import TrainingData, build_training_data, dataset_labels
from hf_tune.errors import RecipeError
from hf_tune.model import build_tokenizer
from hf_tune.model.memory import model_state_memory
from hf_tune.model.meta import build_meta_model
from hf_tune.model.moe import moe_shape
from hf_tune.optim import group_summary, layerwise_param_groups, recipe_param_infos
from hf_tune.recipe.schema import Recipe
from hf_tune.training_args import build_training_arguments

logger = logging.getLogger(__name__)

__all__ = ["model_state_memory", "plan", "steps_per_epoch"]


def steps_per_epoch(num_examples: int, per_device_batch: int, accumulation: int, world_size: int) -> int:
    """Optimizer steps per epoch as Trainer counts them: accelerate shards ceil(n / batch) batches over the ranks
    (padding the last round), and a partial accumulation window at the end of an epoch still steps."""
    batches_per_rank = math.ceil(math.ceil(num_examples / per_device_batch) / world_size)
    return max(math.ceil(batches_per_rank / accumulation), 1)


def plan(recipe: Recipe, world_size: int | None = None, out_dir: str | Path | None = None) -> dict:
    """Everything the run will do, without reading a weight: the model is built on the meta device from its config
    (``hf_tune.model.meta``), the data is read and tokenized as training would (when the tokenizer is at hand), and
    the LR of every optimizer group comes from the real scheduler. Writes ``lr_schedule.png`` (one line per group)
    into ``out_dir`` (default: the run's output_dir) when the step count is known."""
    args = build_training_arguments(recipe)
    # the machine the recipe was written for, unless told otherwise, else the launch this runs under
    world = world_size or (recipe.machine.world_size if recipe.machine else None) or args.world_size
    method = method_of(recipe.method)
    data, missing, processor = plan_data(recipe, args)
    labels = data.labels if data is not None else (
        dataset_labels(recipe) if task_of(recipe.model.task).class_labels else None)
    model = build_meta_model(recipe, labels)
    generations = getattr(args, "num_generations", None) or 1 if method.generates else 1
    # GRPO's sampler repeats each prompt num_generations times, and its batch counts completions
    examples = None if data is None or recipe.data.streaming else len(data.train)  # a stream is not read ahead
    per_epoch = None if examples is None else steps_per_epoch(
        examples * generations, args.per_device_train_batch_size, args.gradient_accumulation_steps, world)
    total = args.max_steps if args.max_steps > 0 else (
        None if per_epoch is None else math.ceil(args.num_train_epochs * per_epoch))
    infos = recipe_param_infos(model, recipe.optim, args.learning_rate, args.weight_decay)
    effective = args.per_device_train_batch_size * args.gradient_accumulation_steps * world
    tokens = None if examples is None else example_tokens(data.train, processor, recipe)
    moe = moe_shape(model)
    result = {
        "method": method.name,
        "method_batch": method_batch(method, effective, generations, recipe.data.batch_tokens),
        "reference": reference_model(recipe, method, args),
        "rollouts": rollout_bounds(recipe, args) if method.generates else None,
        "examples": examples,
        "data_not_read": missing,
        "tokens_per_example": tokens,
        "world_size": world,
        "effective_batch_size": effective,
        "steps_per_epoch": per_epoch,
        "total_steps": total,
        "warmup_steps": None if total is None else args.get_warmup_steps(total),
        "lr_scheduler_type": str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)),
        "groups": group_summary(infos),
        "trainable_params": sum(info.numel for info in infos),
        "moe": moe.describe() if moe else None,
        **plan_memory(recipe, args, model, world, longest_example(data, recipe), tokens),
        "machine": recipe.machine.model_dump(exclude_none=True) if recipe.machine else None,
        "lr_schedule_png": None,
    }
    if total:
        out = Path(out_dir or args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        curves, groups = lr_curves(model, infos, args, total)
        result["lr_schedule_png"] = str(plot_schedule(curves, groups, out / run_folder.LR_SCHEDULE_PLOT))
    return result


def plan_data(recipe: Recipe, args) -> tuple[TrainingData | None, str | None, object]:
    """(the training data as the run reads it, None, the tokenizer or processor), or (None, why, None) when the
    tokenizer a supervised run needs is neither local nor reachable (a plan of a 70B recipe on a laptop offline)."""
    method = method_of(recipe.method)
    if method.uses_trl:  # TRL's layouts, read without a tokenizer
        return build_method_data(recipe, args), None, None
    try:
        tokenizer = build_tokenizer(recipe)
    except RecipeError as err:
        if err.key != "model.pretrained_model_name_or_path":
            raise
        if format_of(recipe.data.format).class_labels:  # images are counted without the processor (it runs per batch)
            return build_training_data(recipe, None, args), None, None
        missing = f"the tokenizer of {recipe.model.pretrained_model_name_or_path} is not at hand ({err.problem})"
        return None, missing, None
    return build_training_data(recipe, tokenizer, args), None, tokenizer


def example_tokens(train, processor, recipe: Recipe) -> dict | None:
    """Tokens per training example (mean, max) as the model reads them, and for a vision-language task the image
    tokens among them: the processor expanded each image into its image tokens (``image_seq_len`` per tile, and as
    many tiles as its image splitting makes) when the data was tokenized. Where the rows are packs
    (``data.batch_tokens``), the examples are counted inside them, with the packs and examples per pack, and
    ``padding_ratio``: the most a pack's examples padded to its longest hold over its tokens (sdpa_varlen pads so).
    None for data without ``input_ids``."""
    if "input_ids" not in train.column_names or not len(train):
        return None
    ids = train["input_ids"]
    packed = isinstance(ids[0], list) and len(ids[0]) and isinstance(ids[0][0], list)
    packs = ids if packed else [[example] for example in ids]
    lengths = [len(example) for pack in packs for example in pack]
    result = {"mean": sum(lengths) / len(lengths), "max": max(lengths), "padding_ratio": pack_padding_ratio(train)}
    if packed:
        result.update(packs=len(packs), examples=len(lengths), examples_per_pack=len(lengths) / len(packs))
    if task_of(recipe.model.task).vision_language:
        image_token = getattr(processor, "image_token", None)
        image_id = processor.tokenizer.convert_tokens_to_ids(image_token) if image_token else None
        result["image_tokens_mean"] = sum(example.count(image_id) for example in ids) / len(ids)
    return result


def longest_example(data: TrainingData | None, recipe: Recipe) -> int | None:
    """Tokens of the longest training example of a vision-language run (its image tokens included), which bounds
    its micro-batches' width; None where the data was not read or the task is not vision-language."""
    if data is None or recipe.data.streaming or not task_of(recipe.model.task).vision_language:
        return None
    return max((len(ids) for ids in data.train["input_ids"]), default=None)


def lr_curves(model, infos, args, total: int) -> tuple[list[list[float]], list[dict]]:
    """The LR of each optimizer group at every optimizer step, from the scheduler ``Trainer.create_scheduler`` builds
    (``get_scheduler`` with the same arguments) over hf_tune's groups."""
    groups = layerwise_param_groups(model, infos)
    optimizer = torch.optim.SGD(groups, lr=args.learning_rate)
    scheduler = get_scheduler(args.lr_scheduler_type, optimizer=optimizer,
                              num_warmup_steps=args.get_warmup_steps(total), num_training_steps=total,
                              scheduler_specific_kwargs=args.lr_scheduler_kwargs)
    curves = [[] for _ in optimizer.param_groups]
    for _ in range(total):
        for curve, group in zip(curves, optimizer.param_groups):
            curve.append(group["lr"])
        optimizer.step()  # no gradients: a no-op that keeps the scheduler's order check quiet
        scheduler.step()
    return curves, optimizer.param_groups


def plan_memory(recipe: Recipe, args, model, world: int, longest: int | None = None,
                tokens_per_example: dict | None = None) -> dict:
    """The run's decisions fitted to the machine (``hf_tune.assembly.decisions``, ``hf_tune.assembly.memory_fit``: the
    budget and what the fit changed), and under them the model states per rank by setup, the activations of one
    micro-batch (measured by the probe on the recipe's architecture, or a formula where it cannot run it, said so), a
    teacher's weights, a generating method's cache, and the estimated peak of the setup the recipe runs.
    ``longest``: tokens of a vision-language run's longest example (image tokens included), whose micro-batches are
    padded to it; ``tokens_per_example``: ``example_tokens``' figures, whose padding ratio sets sdpa_varlen's padded
    gathers."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    ratio = (tokens_per_example or {}).get("padding_ratio")
    decisions = decide(recipe, args, base.config, model=model, world=world, padding_ratio=ratio)
    result = estimate_peak(recipe, args, decisions, model, world, longest, ratio)
    result["decisions"] = decisions.to_dict()
    return result


def rollout_bounds(recipe: Recipe, args) -> dict:
    """What one rollout of a generating method may hold: its generations per prompt, the completion tokens (every
    turn and tool result together, TRL's ``max_completion_length``), the tool rounds (``max_tool_calling_iterations``;
    None: unbounded) and the tools it is offered (the ``agent`` section's)."""
    return {"generations": getattr(args, "num_generations", None) or 1,
            "completion_tokens": getattr(args, "max_completion_length", None),
            "tool_rounds": getattr(args, "max_tool_calling_iterations", None) if recipe.agent else 0,
            "tools": offered_tool_names(recipe.agent)}


def method_batch(method, effective: int, generations: int, batch_tokens: int | None = None) -> str:
    """What one optimizer step trains on, in the method's own units."""
    if method.teacher:
        return (f"{effective} prompts per step, one completion each sampled by the student and matched token by "
                "token to the teacher's distribution")
    if method.generates:
        return (f"{effective} completions per step: {effective / generations:g} prompts x {generations} generations "
                "(training.num_generations), each scored by the rewards")
    if format_of(method.formats[0]).sequences == 2:  # its default data: pairs
        return f"{effective} pairs per step: {2 * effective} sequences (chosen and rejected) through the model"
    if batch_tokens:
        return (f"{effective} pack{'s' if effective > 1 else ''} per step, each of whole examples up to "
                f"{batch_tokens} tokens (data.batch_tokens): at most {effective * batch_tokens:,} tokens")
    return f"{effective} examples per step"


def reference_model(recipe: Recipe, method, args) -> str:
    """What the method compares against: nothing, or the frozen reference (the base under the adapter, or a copy):
    dpo and kto always, grpo and rloo where their KL penalty is on (``training.beta`` > 0)."""
    if not (method.reference or method.rewarded and getattr(args, "beta", 0.0)):
        return "none"
    return "the base with the adapter disabled (no copy)" if recipe.lora is not None else \
        "a frozen copy of the model (full fine-tune)"


def plot_schedule(curves: list[list[float]], groups: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for curve, group in zip(curves, groups):
        depths = group.get("depths", [])
        where = f"depth {min(depths)}" + (f"-{max(depths)}" if len(set(depths)) > 1 else "") if depths else "group"
        ax.plot(range(len(curve)), curve, label=f"{where}, wd {group['weight_decay']:g}",
                linestyle="--" if group["weight_decay"] == 0 else "-")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("learning rate")
    ax.set_title("Learning rate per optimizer group")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
