"""``hf-tune chat RUN_DIR``: one prompt answered, or a conversation typed at the terminal, through the run's chat
template (``workflows/inference.py`` loads the run and replies)."""

from __future__ import annotations

import sys

from hf_tune.commands.verb import DEVICE, DTYPE, GENERATION, RUN_DIR, Verb, option


def run(args) -> None:
    from hf_tune.workflows.inference import load_trained, reply  # loads torch: only when the verb runs

    model, tokenizer = load_trained(args.run_dir, device=args.device, dtype=args.dtype)
    print(f"{args.run_dir} on {model.device} in {model.dtype}", file=sys.stderr)
    sampling = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_p": args.top_p,
                "seed": args.seed, "stream": True}
    messages = [{"role": "system", "content": args.system}] if args.system else []
    if args.prompt:
        messages.append({"role": "user", "content": args.prompt})
        print(f"user: {args.prompt}\nassistant: ", end="", flush=True)
        reply(model, tokenizer, messages, **sampling)
        return
    print("Type a message (empty line or Ctrl-D to quit).")
    while text := read_line("you> "):
        messages.append({"role": "user", "content": text})
        print("model> ", end="", flush=True)
        messages.append({"role": "assistant", "content": reply(model, tokenizer, messages, **sampling)})


def read_line(prompt: str) -> str | None:
    try:
        return input(prompt)
    except EOFError:
        return None


VERB = Verb(run, "talk to a trained run (adapter or full model)", options=(
    RUN_DIR, option("--prompt", help="one message, answered once (default: interactive)"),
    option("--system", help="a system message"), *GENERATION, DEVICE, DTYPE))
