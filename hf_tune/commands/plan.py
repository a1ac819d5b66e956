"""``hf-tune plan RECIPE``: batch sizes, steps, optimizer groups, memory and the schedule, without training
(``hf_tune.workflows.plan.plan``), and their printout."""

from __future__ import annotations

from hf_tune.commands.option_types import whole
from hf_tune.commands.verb import Verb, option
from hf_tune.runtime.output_paths import Output


def _tokens_line(tokens: dict | None) -> str:
    if not tokens:
        return ""
    images = tokens.get("image_tokens_mean")
    return (f"   tokens per example: mean {tokens['mean']:.1f}, max {tokens['max']}"
            + (f" (image tokens: {images:.1f} on average)" if images is not None else ""))


def teacher_line(teacher: dict) -> str:
    where = "partitioned over the ranks (ZeRO-3)" if teacher["partitioned"] else "whole on each rank"
    return (f"teacher: {teacher['name']}, {teacher['params']:,} parameters in {teacher['dtype']}, frozen: "
            f"{teacher['bytes_per_rank'] / 2**30:.2f} GB per rank ({where})")


def fit_lines(memory: dict | None) -> list[str]:
    """The memory fit, as plan prints it: the budget, what hf_tune changed to meet it, or what keeps it from fitting."""
    if not memory:
        return []
    if memory.get("checked", "").startswith("not estimated"):
        return [f"  memory budget {memory['budget']}: {memory['checked']}"]
    lines = [f"  {'fits' if memory['fits'] else 'does NOT fit'} the memory budget of {memory['budget']}"]
    lines += [f"  fitted: {change}" for change in memory["changed"]]
    if not memory["fits"]:
        keys = memory["keys_in_the_way"]
        lines.append(f"  fix: remove {' and '.join(keys)} so that hf_tune fits the run" if keys else
                     "  fix: `hf-tune init MODEL --gpus N --gpu-memory GB` writes the fastest recipe that fits "
                     "(ZeRO, activation checkpointing, smaller packs, QLoRA, or LoRA on attention only for a "
                     "mixture of experts)")
    return lines


def format_plan(result: dict) -> str:
    """``plan``'s result as ``hf-tune plan`` prints it."""
    png = result["lr_schedule_png"] or "none (the step count is not known)"
    return "\n".join([*_run_lines(result), *_memory_lines(result), f"\nLR schedule plot: {png}"])


def _run_lines(result: dict) -> list[str]:
    """The method, the data, the batch and steps, the parameter groups."""
    missing = result.get("data_not_read")
    streamed = result["examples"] is None and not missing
    examples = f"not counted: {missing}" if missing else "streamed, counted as read" if streamed else result["examples"]
    packed = result.get("tokens_per_example") or {}
    if packed.get("packs"):
        examples = (f"{packed['examples']} in {packed['packs']} packs ({packed['examples_per_pack']:.1f} examples a "
                    "pack, data.batch_tokens)")
    per_epoch = "- (a stream: training.max_steps)" if streamed else result["steps_per_epoch"]
    total = result["total_steps"] if result["total_steps"] is not None else "- (set training.max_steps)"
    lines = [f"method: {result['method']} ({result['method_batch']})", *_rollout_lines(result.get("rollouts")),
             f"reference model: {result['reference']}",
             *([teacher_line(result["teacher"])] if result.get("teacher") else []),
             f"examples: {examples}{_tokens_line(result.get('tokens_per_example'))}",
             f"world size: {result['world_size']}   effective batch: {result['effective_batch_size']}",
             f"steps per epoch: {per_epoch or '-'}   total steps: {total}   "
             f"warmup steps: {result['warmup_steps'] if result['warmup_steps'] is not None else '-'}   "
             f"schedule: {result['lr_scheduler_type']}",
             f"trainable parameters: {result['trainable_params']:,}",
             *([result["moe"]] if result.get("moe") else []), "",
             f"{'depth':>5} {'decay':>5} {'tensors':>7} {'params':>12} {'peak lr':>11} {'wd':>6}"]
    for row in result["groups"]:
        lines.append(f"{row['depth']:>5} {'yes' if row['weight_decay'] else 'no':>5} {row['tensors']:>7} "
                     f"{row['params']:>12,} {row['lr']:>11.3e} {row['weight_decay']:>6g}")
    return lines


def _rollout_lines(rollouts: dict | None) -> list[str]:
    if not rollouts:
        return []
    tokens = rollouts["completion_tokens"]
    line = f"rollouts: {rollouts['generations']} per prompt, up to {tokens} completion tokens each"
    if rollouts["tools"]:
        rounds = rollouts["tool_rounds"]
        line += (" (its turns and tool results together); " + (f"up to {rounds} tool round(s)" if rounds else
                 "tool rounds unbounded (training.max_tool_calling_iterations)")
                 + f"; tools: {', '.join(rollouts['tools'])}")
    return [line]


def _memory_lines(result: dict) -> list[str]:
    """The weights, the model states per setup, the activations, the decisions, the peak and the fit."""
    lines = []
    quantized = result.get("quantized_weights")
    if quantized:
        lines.append(f"\nweights ({quantized['quantization']}): {quantized['bytes'] / 2**30:.3f} GB for "
                     f"{quantized['params']:,} parameters "
                     f"({quantized['full_precision_bytes'] / 2**30:.3f} GB unquantized)")
    lines.append(f"\nmodel-state memory per rank ({result['world_size']} ranks, {result['memory_precision']}, AdamW; "
                 "activations not included):")
    lines.append(f"{'setup':<16} {'accelerator':>12} {'CPU':>10}")
    for setup, (device, cpu) in result["memory_per_rank"].items():
        mark = "  <- this recipe" if setup == result["setup"] else ""
        lines.append(f"{setup:<16} {device / 2**30:>10.2f} GB {cpu / 2**30:>7.2f} GB{mark}")
    act = result["activations"]
    if act["tokens"]:
        lines.append(f"activations: {act['bytes'] / 2**30:.2f} GB kept for backward, {act['peak_bytes'] / 2**30:.2f} "
                     f"GB at the peak of forward and backward, for {act['tokens']:,} tokens a micro-batch (activation "
                     f"checkpointing {'on' if act['checkpointing'] else 'off'})")
        lines.append(f"  {act['source']}: {act['detail']}")
    else:
        lines.append("activations: not estimated for image models")
    decided = result.get("decisions") or {}
    if decided:
        lines.append(f"  decided: attention {decided['attention'] or 'transformers default'}, padding-free "
                     f"{'on' if decided['padding_free'] else 'off'}, chunked loss "
                     f"{'on' if decided['chunked_loss'] else 'off'}"
                     f", weights {decided['weights_dtype']}, mixed precision {decided['mixed_precision'] or 'off'}"
                     + (", Liger (not run by the probe: the figure is an upper bound)" if decided["liger"] else "")
                     + (f", router load-balancing loss x {decided['router_aux_loss_coef']:g}"
                        if decided.get("router_aux_loss_coef") else ""))
    from hf_tune.model.memory import RUNTIME_RESERVE_BYTES  # loads torch: plan has loaded it already

    teacher = " + the teacher's weights" if result.get("teacher") else ""
    lines.append(f"estimated peak per rank ({result['setup']}): {result['peak_per_rank'] / 2**30:.2f} GB "
                 f"(model states + activations at their peak{teacher} + {RUNTIME_RESERVE_BYTES / 2**30:g} GB runtime "
                 "reserve)")
    if result.get("generation_cache_bytes"):
        lines.append(f"  + {result['generation_cache_bytes'] / 2**30:.2f} GB of keys and values while a micro-batch's "
                     "completions are sampled")
    return lines + fit_lines(decided.get("memory"))


def run(args) -> None:
    from hf_tune.assembly.loading import load_recipe  # loads transformers: only when the verb runs
    from hf_tune.workflows.plan import plan

    print(format_plan(plan(load_recipe(args.recipe, args.overrides), world_size=args.world_size, out_dir=args.out)))


VERB = Verb(run, "batch sizes, steps, optimizer groups and lr_schedule.png, without training", True, (
    option("--world-size", type=whole(1), default=None, help="plan for N processes (default: this launch's)"),
    option("--out", default=None, help="folder for lr_schedule.png (default: training.output_dir)")),
    output=Output("folder"))
