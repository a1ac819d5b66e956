"""``hf-tune init MODEL``: a recipe whose plan fits the machine, each choice commented (``workflows/init_recipe.py``
chooses and writes it)."""

from __future__ import annotations

from hf_tune.commands.option_types import gpu_memory_gb, whole
from hf_tune.commands.verb import Verb, option, written_by_init
from hf_tune.runtime.output_paths import Output


def run(args) -> None:
    from hf_tune.workflows.init_recipe import write_recipe  # loads torch: only when the verb runs

    out = args.out or f"{args.model.rsplit('/', 1)[-1].lower()}-{args.gpus}x{args.gpu_memory:g}gb.yaml"
    choice = write_recipe(args.model, out, gpus=args.gpus, gpu_memory_gb=args.gpu_memory, tuning=args.tuning,
                          setup=args.setup, max_length=args.max_length, data=args.data)
    print(f"wrote {out}: {choice.tuning}, {choice.setup}, activation checkpointing "
          f"{'on' if choice.checkpointing else 'off'}, packs of {choice.tokens:,} tokens x {choice.accumulation} "
          f"accumulated; estimated peak {choice.peak / 2**30:.1f} GB per GPU of {args.gpu_memory:g} GB")
    if args.data is None:
        print("data.train.path is the placeholder data/train.jsonl: put your chat JSONL there, or edit the recipe")


VERB = Verb(run, "write a recipe for MODEL whose plan fits the machine (each choice commented)", options=(
    option("model", help="a Hub id, local folder or embedded: name (its config is read, no weight)"),
    option("--gpus", type=whole(1, 4096), default=1, help="GPUs the run uses (default 1)"),
    option("--gpu-memory", type=gpu_memory_gb, default=80, help="GB of memory per GPU (default 80)"),
    option("--tuning", default="auto", choices=["auto", "full", "lora", "qlora"],
           help="default: the fastest that fits (full for models under 2B parameters, then LoRA, then QLoRA)"),
    option("--setup", default="auto", choices=["auto", "ddp", "zero2", "zero3"],
           help="distribution (default: the fastest that fits: DDP, then ZeRO-2, then ZeRO-3)"),
    option("--max-length", type=whole(1), default=4096, help="longest example in tokens (data.max_length)"),
    option("--data", default=None, help="chat data (JSONL of messages) for data.train.path (default: the "
           "placeholder data/train.jsonl, which the recipe says to fill)"),
    option("--out", default=None, help="the recipe file (default: NAME-NxGBgb.yaml; a file init did not write "
           "is never overwritten)")), output=Output("file", ours=written_by_init, inputs=("data",)))
