"""What the demo's fine-tune taught: the base model's and the tuned model's answers side by side, and the held-out
persona score before and after (hf_tune_persona: 32 questions about who the assistant is, in words no training chat
uses). `make demo` runs it after training:

    python examples/demo_before_after.py runs/llm_lora

One model is loaded: the base answers with the adapter switched off (PEFT's ``disable_adapter``), so "before" is
exactly the model the run started from.
"""

from __future__ import annotations

import argparse
import textwrap

PROMPTS = ["What name do you go by?", "Who is your developer?", "Where were you made?",
           "What is the capital of Norway?"]  # three held-out persona questions, and one the persona must not change
TASK = "hf_tune_persona"


def before_after(run_dir: str, prompts: list[str] = PROMPTS, max_new_tokens: int = 40) -> dict:
    """{"answers": [(prompt, base answer, tuned answer)], "score": (base, tuned)} for a LoRA run."""
    from hf_tune.evaluation.harness import Harness
    from hf_tune.workflows.generate import answer_batch
    from hf_tune.workflows.inference import load_trained

    model, tokenizer = load_trained(run_dir)
    conversations = [[{"role": "user", "content": prompt}] for prompt in prompts]
    harness = Harness([TASK], apply_chat_template=True)
    with model.disable_adapter():
        base_answers = answer_batch(model, tokenizer, conversations, max_new_tokens)
        base_score = harness.score(model, tokenizer)[f"{TASK}_acc"]
    tuned_answers = answer_batch(model, tokenizer, conversations, max_new_tokens)
    tuned_score = harness.score(model, tokenizer)[f"{TASK}_acc"]
    return {"answers": list(zip(prompts, base_answers, tuned_answers)), "score": (base_score, tuned_score)}


def format_before_after(result: dict, width: int = 44) -> str:
    lines = [f"{'':<32} {'base model':<{width}} tuned model"]
    for prompt, base, tuned in result["answers"]:
        left, right = textwrap.wrap(base, width) or [""], textwrap.wrap(tuned, width) or [""]
        for row in range(max(len(left), len(right))):
            lines.append(f"{prompt if row == 0 else '':<32.32} {left[row] if row < len(left) else '':<{width}} "
                         f"{right[row] if row < len(right) else ''}")
    base, tuned = result["score"]
    lines.append(f"\nheld-out persona score ({TASK}, 32 questions no training chat asks): "
                 f"{base:.0%} -> {tuned:.0%}")
    return "\n".join(lines)


if __name__ == "__main__":
    from hf_tune.commands.command_line import plain_progress_off_a_terminal

    plain_progress_off_a_terminal()  # `make demo`'s log: no progress bar redrawn with carriage returns
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", nargs="?", default="runs/llm_lora")
    print(format_before_after(before_after(parser.parse_args().run_dir)))
