"""``hf-tune eval RUN_DIR``: lm-eval scores of a run, one checkpoint, or each new complete checkpoint of a run in
progress (``workflows/evaluate.py``), each scored line printed as JSON."""

from __future__ import annotations

import json

from hf_tune.commands.option_types import device_here, number, whole
from hf_tune.commands.verb import Verb, option


def run(args) -> None:
    from hf_tune.workflows.evaluate import evaluate_run  # loads transformers: only when the verb runs

    tasks = [t for t in args.tasks.split(",") if t] if args.tasks else None
    lines = evaluate_run(args.run_dir, checkpoint=args.checkpoint, watch=args.watch, interval=args.interval,
                         wait=args.wait, device=args.device, dtype=args.dtype, tasks=tasks, limit=args.limit,
                         num_fewshot=args.num_fewshot, batch_size=args.batch_size,
                         apply_chat_template=args.apply_chat_template)
    if not args.watch:  # --watch prints each line as it is scored
        for line in lines:
            print(json.dumps(line))


VERB = Verb(run, "lm-eval scores of a run, one checkpoint, or (--watch) each new complete checkpoint of a run in "
            "progress, into RUN_DIR/eval_scores.jsonl", options=(
                option("run_dir", help="a run folder (its recipe's evaluation.tasks), or a model folder with --tasks"),
                option("--checkpoint", type=whole(0), default=None, metavar="N",
                       help="score checkpoint-N (complete ones only)"),
                option("--watch", action="store_true",
                       help="score each complete checkpoint as it appears, until the run ends"),
                option("--interval", type=number(0, low_open=True), default=10.0,
                       help="seconds between looks for new checkpoints (--watch)"),
                option("--wait", type=number(0), default=600.0, help="seconds to wait for RUN_DIR to appear (--watch "
                       "started before the run); a path whose parent does not exist is refused at once"),
                option("--tasks", default=None,
                       help="comma-separated lm-eval tasks or task YAMLs (default: the recipe's)"),
                option("--limit", type=number(0, low_open=True), default=None,
                       help="examples per task (a fraction if < 1)"),
                option("--num-fewshot", type=whole(0), default=None),
                option("--batch-size", type=whole(1), default=None),
                option("--apply-chat-template", action="store_true", default=None,
                       help="ask each prompt as a user turn through the chat template (lm-eval's apply_chat_template)"),
                option("--device", type=device_here, default=None), option("--dtype", default=None)))
