"""Generation samples at each evaluation: the recipe's prompts (``evaluation.samples``) generated greedily, so the
same weights give the same text, appended to the run folder's ``samples.jsonl`` and sent to the trackers of
``training.report_to`` that take them (``hf_tune.catalog.trackers``: a W&B table, an MLflow artifact, TensorBoard
text)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from transformers import TrainerCallback

from hf_tune.catalog.trackers import reported
from hf_tune.run_folder import SAMPLES

logger = logging.getLogger(__name__)


def generate_samples(model, tokenizer, prompts: list[str], max_new_tokens: int) -> list[str]:
    """Greedy completions of ``prompts``, one at a time (no padding to change them), each rendered by the tokenizer's
    chat template as a user turn where it has one."""
    import torch

    was_training = model.training
    model.eval()
    completions = []
    try:
        for prompt in prompts:
            if getattr(tokenizer, "chat_template", None):
                text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                     add_generation_prompt=True)
            else:
                text = prompt
            inputs = tokenizer(text, return_tensors="pt", add_special_tokens=False).to(model.device)
            with torch.no_grad():
                out = model.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens,
                                     pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
            completions.append(tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
    finally:
        model.train(was_training)
    return completions


class GenerationSamples(TrainerCallback):
    """At each evaluation, on the main process: the prompts' greedy completions to ``samples.jsonl`` and the
    trackers."""

    def __init__(self, prompts: list[str], max_new_tokens: int = 64):
        self.prompts, self.max_new_tokens = list(prompts), max_new_tokens

    def on_evaluate(self, args, state, control, model=None, processing_class=None, **kwargs):
        if not state.is_world_process_zero or model is None or processing_class is None:
            return
        completions = generate_samples(model, processing_class, self.prompts, self.max_new_tokens)
        rows = [{"step": state.global_step, "prompt": p, "completion": c} for p, c in zip(self.prompts, completions)]
        path = Path(args.output_dir) / SAMPLES
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as file:
            file.writelines(json.dumps(row) + "\n" for row in rows)
        report_samples(args, rows, path, state.global_step)


def report_samples(args, rows: list[dict], path: Path, step: int) -> None:
    """The samples to each tracker of ``args.report_to`` that takes them (a tracker's failure is logged, not raised:
    samples never stop training)."""
    for tracker in reported(args.report_to):
        if tracker.samples:
            try:
                tracker.function("samples")(args, rows, path, step)
            except Exception as err:  # noqa: BLE001  (a tracker's own error)
                logger.warning("Generation samples were not sent to %s: %s", tracker.name, err)
