"""Generation samples at each evaluation: the recipe's prompts (``evaluation.samples``) generated greedily, so the
same weights give the same text, appended to the run folder's ``samples.jsonl`` and sent to the trackers of
``training.report_to`` (a W&B table, an MLflow artifact, TensorBoard text)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from transformers import TrainerCallback

from hf_tune.lifecycle.run_folder import SAMPLES, TENSORBOARD_DIR

SAMPLES_TENSORBOARD_RUN = "samples"  # the TensorBoard run of the samples' text

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
    """The samples to each tracker of ``args.report_to`` that has a run open (a tracker's failure is logged, not
    raised: samples never stop training)."""
    targets = set(args.report_to or [])
    for name, send in (("wandb", _to_wandb), ("mlflow", _to_mlflow), ("tensorboard", _to_tensorboard)):
        if name in targets:
            try:
                send(args, rows, path, step)
            except Exception as err:  # noqa: BLE001  (a tracker's own error)
                logger.warning("Generation samples were not sent to %s: %s", name, err)


def _to_wandb(args, rows, path, step) -> None:
    import wandb

    if wandb.run is not None:
        table = wandb.Table(columns=["step", "prompt", "completion"],
                            data=[[r["step"], r["prompt"], r["completion"]] for r in rows])
        wandb.run.log({"eval/samples": table}, commit=False)


def _to_mlflow(args, rows, path, step) -> None:
    import mlflow

    if mlflow.active_run() is not None:
        mlflow.log_artifact(str(path))  # the whole file: every evaluation's samples so far


def _to_tensorboard(args, rows, path, step) -> None:
    from torch.utils.tensorboard import SummaryWriter

    text = "\n\n".join(f"**{r['prompt']}**\n\n{r['completion']}" for r in rows)
    # a TensorBoard run of its own beside Trainer's (TENSORBOARD_LOGGING_DIR, else output_dir/runs/<date_host>)
    root = os.environ.get("TENSORBOARD_LOGGING_DIR") or str(Path(args.output_dir) / TENSORBOARD_DIR)
    with SummaryWriter(log_dir=str(Path(root) / SAMPLES_TENSORBOARD_RUN)) as writer:
        writer.add_text("eval/samples", text, global_step=step)
