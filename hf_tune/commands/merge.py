"""``hf-tune merge RUN_DIR``: a LoRA run's adapter merged into its base, shard by shard (``workflows/merge_run.py``),
optionally checked against base + adapter."""

from __future__ import annotations

from hf_tune.commands.verb import RUN_DIR, Verb, option
from hf_tune.runtime.output_paths import Output


def run(args) -> None:
    from hf_tune.workflows.merge_run import merge

    result = merge(args.run_dir, out=args.out, dtype=args.dtype, check=args.check)
    print(f"merged model: {result['merged_dir']} ({result['dtype']})")
    if args.check:
        print(f"check: max |Δ logit| = {result['max_abs_logit_diff']:.3g} ({result['relative_diff']:.2e} of the "
              f"largest logit; tolerance {result['tolerance']:g}): ok")


VERB = Verb(run, "merge a LoRA run's adapter into its base model", options=(
    RUN_DIR, option("--out", default=None, help="default: RUN_DIR/merged"),
    option("--dtype", default="float32", help="float32 | bfloat16 | float16 (a QLoRA run's 4-bit base is dequantized "
           "to it); the merge streams the base's safetensors shard by shard"),
    option("--check", action="store_true", help="compare merged logits with base + adapter (one model in memory at "
           "a time)")), output=Output("folder", inputs=("run_dir",)))
