"""``hf-tune plan``: batch sizes, step counts, optimizer groups and the LR schedule of a recipe, without training."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from hf_tune import run_folder
from hf_tune.build import build_run
from hf_tune.methods import method_of
from hf_tune.optim import group_summary, recipe_param_infos
from hf_tune.recipe.schema import Recipe


def steps_per_epoch(num_examples: int, per_device_batch: int, accumulation: int, world_size: int) -> int:
    """Optimizer steps per epoch as Trainer counts them: accelerate shards ceil(n / batch) batches over the ranks
    (padding the last round), and a partial accumulation window at the end of an epoch still steps."""
    batches_per_rank = math.ceil(math.ceil(num_examples / per_device_batch) / world_size)
    return max(math.ceil(batches_per_rank / accumulation), 1)


def model_state_memory(total: int, trainable: int, largest_layer: int, world_size: int, mixed_precision: bool,
                       param_bytes: int) -> dict[str, tuple[float, float]]:
    """(accelerator bytes, CPU bytes) per rank for weights, gradients and AdamW states, by setup.

    DeepSpeed's accounting (its ``estimate_zero{2,3}_model_states_mem_needs`` for a full fine-tune): under mixed
    precision a trained parameter costs a 16-bit weight and gradient plus fp32 gradient, master weight and two Adam
    moments (2 + 2 + 4 + 4 + 8 bytes; ZeRO-3 frees the 16-bit gradient once reduced); in fp32, weight 4 + gradient 4
    + moments 8. ZeRO-2 partitions gradients and optimizer states over the ranks, ZeRO-3 the weights too and gathers
    one layer at a time (``4 x largest_layer``);
    offload moves what it partitions to CPU (the bundled zero3_offload offloads weights as well). Frozen weights
    (LoRA's base) cost their weight only. Activations are not included: they scale with tokens per step.
    """
    n = world_size
    weight = 2 if mixed_precision else param_bytes
    partitioned = trainable * (18 if mixed_precision else 12)  # everything per trained parameter but its weight
    partitioned3 = trainable * (16 if mixed_precision else 12)
    gathered = 4 * largest_layer
    ddp = total * param_bytes + trainable * param_bytes * 3  # weights, gradients, two Adam moments in the same dtype
    return {
        "no ZeRO (DDP)": (ddp, 0),
        "ZeRO-2": (total * weight + partitioned / n, 0),
        "ZeRO-2 offload": (total * weight, partitioned / n),
        "ZeRO-3": (gathered + (total * weight + partitioned3) / n, 0),
        "ZeRO-3 offload": (gathered, (total * weight + partitioned3) / n),
    }


def model_state_sizes(model) -> tuple[int, int, int]:
    """Parameters (tied ones once), trained parameters, and the most parameters any one module holds itself."""
    unique = {p.data_ptr(): p for p in model.parameters()}.values()
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    return sum(p.numel() for p in unique), sum(p.numel() for p in unique if p.requires_grad), largest


def plan(recipe: Recipe, world_size: int | None = None, out_dir: str | Path | None = None) -> dict:
    """Everything the run will do, computed with the real model, data, optimizer and scheduler. Writes
    ``lr_schedule.png`` (one line per optimizer group) into ``out_dir`` (default: the run's output_dir)."""
    if method_of(recipe.method).reference:  # a plan needs no reference pass over the data
        recipe = dataclasses.replace(recipe, training={**recipe.training, "precompute_ref_log_probs": False})
    run = build_run(recipe, check_launch=False)  # plans for a launch other than this one
    args, model, train_dataset, trainer = run.args, run.model, run.data.train, run.trainer
    world = world_size or args.world_size
    method = method_of(recipe.method)
    generations = getattr(args, "num_generations", None) or 1 if method.generates else 1
    # GRPO's sampler repeats each prompt num_generations times, and its batch counts completions
    examples = None if recipe.data.streaming else len(train_dataset)  # a stream is not read ahead
    per_epoch = None if examples is None else steps_per_epoch(
        examples * generations, args.per_device_train_batch_size, args.gradient_accumulation_steps, world)
    total = args.max_steps if args.max_steps > 0 else math.ceil(args.num_train_epochs * per_epoch)
    infos = recipe_param_infos(model, recipe.optim, args.learning_rate, args.weight_decay)
    trainer.create_optimizer_and_scheduler(num_training_steps=total)
    groups = trainer.optimizer.param_groups
    curves = [[] for _ in groups]
    for _ in range(total):  # the LR each optimizer step will use, from the real scheduler
        for curve, group in zip(curves, groups):
            curve.append(group["lr"])
        trainer.optimizer.step()  # no gradients: a no-op that keeps the scheduler's order check quiet
        trainer.lr_scheduler.step()

    effective = args.per_device_train_batch_size * args.gradient_accumulation_steps * world
    result = {
        "method": method.name,
        "method_batch": method_batch(method, effective, generations, recipe.data.batch_tokens),
        "examples": examples,
        "world_size": world,
        "effective_batch_size": effective,
        "steps_per_epoch": per_epoch,
        "total_steps": total,
        "warmup_steps": args.get_warmup_steps(total),
        "lr_scheduler_type": str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)),
        "groups": group_summary(infos),
        "trainable_params": sum(info.numel for info in infos),
    }
    total, trainable, largest = model_state_sizes(model)
    mixed = bool(args.bf16 or args.fp16)
    param_bytes = next(model.parameters()).element_size()
    result["memory_per_rank"] = model_state_memory(total, trainable, largest, world, mixed, param_bytes)
    if recipe.model.quantization_config:  # the weights as stored; ZeRO-3 cannot partition them (refused at load)
        from hf_tune.model.quantization import describe, weight_memory

        weights = weight_memory(model)
        result["quantized_weights"] = {**weights, "quantization": describe(recipe.model.quantization_config)}
        states = trainable * (18 if mixed else 12)  # a trained (adapter) parameter's gradient and AdamW moments
        result["memory_per_rank"] = {"no ZeRO (DDP)": (weights["bytes"] + states, 0),
                                     "ZeRO-2": (weights["bytes"] + states / world, 0),
                                     "ZeRO-2 offload": (weights["bytes"], states / world)}
    result["memory_precision"] = ("mixed 16-bit" if mixed else str(next(model.parameters()).dtype).split(".")[-1])
    out = Path(out_dir or args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    result["lr_schedule_png"] = str(plot_schedule(curves, groups, out / run_folder.LR_SCHEDULE_PLOT))
    return result


def method_batch(method, effective: int, generations: int, batch_tokens: int | None = None) -> str:
    """What one optimizer step trains on, in the method's own units."""
    if method.generates:
        return (f"{effective} completions per step: {effective / generations:g} prompts x {generations} generations "
                "(training.num_generations), each scored by the rewards")
    if method.reference or method.name == "reward":
        return f"{effective} pairs per step: {2 * effective} sequences (chosen and rejected) through the model"
    if batch_tokens:
        return (f"{effective} pack{'s' if effective > 1 else ''} per step, each of whole examples up to "
                f"{batch_tokens} tokens (data.batch_tokens): at most {effective * batch_tokens:,} tokens")
    return f"{effective} examples per step"


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


def format_plan(result: dict) -> str:
    streamed = result["examples"] is None
    lines = [f"method: {result['method']} ({result['method_batch']})",
             f"examples: {'streamed, counted as read' if streamed else result['examples']}   "
             f"world size: {result['world_size']}   effective batch: {result['effective_batch_size']}",
             f"steps per epoch: {'- (a stream: training.max_steps)' if streamed else result['steps_per_epoch']}   "
             f"total steps: {result['total_steps']}   "
             f"warmup steps: {result['warmup_steps']}   schedule: {result['lr_scheduler_type']}",
             f"trainable parameters: {result['trainable_params']:,}", "",
             f"{'depth':>5} {'decay':>5} {'tensors':>7} {'params':>12} {'peak lr':>11} {'wd':>6}"]
    for row in result["groups"]:
        lines.append(f"{row['depth']:>5} {'yes' if row['weight_decay'] else 'no':>5} {row['tensors']:>7} "
                     f"{row['params']:>12,} {row['lr']:>11.3e} {row['weight_decay']:>6g}")
    quantized = result.get("quantized_weights")
    if quantized:
        lines.append(f"\nweights ({quantized['quantization']}): {quantized['bytes'] / 2**30:.3f} GB for "
                     f"{quantized['params']:,} parameters ({quantized['full_precision_bytes'] / 2**30:.3f} GB unquantized)")
    lines.append(f"\nmodel-state memory per rank ({result['world_size']} ranks, {result['memory_precision']}, AdamW; "
                 "activations not included):")
    lines.append(f"{'setup':<16} {'accelerator':>12} {'CPU':>10}")
    for setup, (device, cpu) in result["memory_per_rank"].items():
        lines.append(f"{setup:<16} {device / 2**30:>10.2f} GB {cpu / 2**30:>7.2f} GB")
    lines.append(f"\nLR schedule plot: {result['lr_schedule_png']}")
    return "\n".join(lines)
