"""``hf-tune generate RUN_DIR --input IN --out OUT``: a run's answers to a JSONL file of prompts, in batches
(``workflows/generate.py``); an interrupted job continues, another job's file is never overwritten."""

from __future__ import annotations

from hf_tune.commands.option_types import whole
from hf_tune.commands.verb import DEVICE, DTYPE, GENERATION, RUN_DIR, Verb, answers_of_this_input, option
from hf_tune.runtime.output_paths import Output


def run(args) -> None:
    from hf_tune.workflows.generate import generate_file  # loads torch: only when the verb runs

    result = generate_file(args.run_dir, args.input, args.out, batch_size=args.batch_size,
                           max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                           seed=args.seed, device=args.device, dtype=args.dtype)
    print(f"{result['out']}: {result['answers']} answers"
          + (f" (the first {result['resumed_after']} kept from an interrupted run)" if result["resumed_after"] else ""))


VERB = Verb(run, "answer a JSONL file of prompts in batches (greedy by default: chat's answers)", options=(
    RUN_DIR, option("--input", required=True, help="JSONL: {\"prompt\": ...} or {\"messages\": [...]} per line"),
    option("--out", required=True, help="JSONL: each input line plus \"answer\" (a rerun continues an interrupted one "
           "of the same input; a file of other answers is never overwritten)"),
    option("--batch-size", type=whole(1), default=8), *GENERATION, DEVICE, DTYPE),
    output=Output("file", ours=answers_of_this_input, inputs=("input", "run_dir")))
