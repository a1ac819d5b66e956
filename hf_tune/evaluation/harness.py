"""lm-evaluation-harness as the engine of downstream scores: the recipe's ``evaluation.tasks`` run on a model in
memory (lm-eval's ``HFLM`` over the model and tokenizer, no copy, no reload), each task's metric named
``<task>_<metric>`` (``eval_`` is the evaluation's prefix), so Trainer's best model, early stopping and a search read
it like ``eval_loss``."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from pathlib import Path
from typing import Any

from hf_tune.errors import HfTuneError
from hf_tune.recipe.evaluation_tasks import SHIPPED_TASKS_DIR, shipped_tasks, task_label

logger = logging.getLogger(__name__)


class Harness:
    """The recipe's lm-eval tasks, indexed once (lm-eval's ``TaskManager`` over its own tasks, hf_tune's shipped
    ones and the folders of the recipe's task YAMLs), scored on any model with ``score``."""

    def __init__(self, tasks: list[str], limit: float | None = None, num_fewshot: int | None = None,
                 batch_size: int = 8, seed: int = 0, apply_chat_template: bool = False):
        from lm_eval.tasks import TaskManager

        self.tasks = [task_label(task) for task in tasks]
        folders = {str(SHIPPED_TASKS_DIR)} | {str(Path(t).resolve().parent) for t in tasks if _is_yaml(t)}
        registered = any(not _is_yaml(task) and task not in shipped_tasks() for task in tasks)
        # lm-eval's own ~15k task files are indexed (~10 s) only when the recipe names one of them
        self.task_manager = TaskManager(include_path=sorted(folders), include_defaults=registered)
        self.limit, self.num_fewshot, self.batch_size, self.seed = limit, num_fewshot, batch_size, seed
        self.apply_chat_template = apply_chat_template

    def score(self, model, tokenizer) -> dict[str, float]:
        """Every task's metrics on ``model`` as ``{"<task>_<metric>": value}`` (in eval mode, gradients off; the
        model's training mode is restored)."""
        import lm_eval
        import torch
        from lm_eval.models.huggingface import HFLM

        was_training = model.training
        model.eval()
        try:
            with torch.no_grad(), _quiet():
                lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=self.batch_size,
                          device=str(model.device))
                if os.environ.get("TQDM_DISABLE"):  # lm-eval hands its bars disable=False, over tqdm's variable
                    for name in ("loglikelihood", "loglikelihood_rolling", "generate_until"):
                        setattr(lm, name, functools.partial(getattr(lm, name), disable_tqdm=True))
                results = lm_eval.simple_evaluate(
                    model=lm, tasks=list(self.tasks), num_fewshot=self.num_fewshot, limit=self.limit,
                    task_manager=self.task_manager, bootstrap_iters=0, log_samples=False,
                    apply_chat_template=self.apply_chat_template,
                    random_seed=self.seed, numpy_random_seed=self.seed, torch_random_seed=self.seed,
                    fewshot_random_seed=self.seed)
        finally:
            model.train(was_training)
        return flat_scores(results["results"]) if results is not None else {}


def flat_scores(results: dict[str, dict[str, Any]]) -> dict[str, float]:
    """lm-eval's ``results`` (``{task: {"acc,none": 0.5, "acc_stderr,none": ..., "alias": ...}}``) as
    ``{"task_acc": 0.5}``: standard errors and aliases dropped, a filter other than ``none`` kept as a suffix
    (``gsm8k_exact_match_strict-match``)."""
    scores = {}
    for task, metrics in results.items():
        for key, value in metrics.items():
            metric, _, filter_name = key.partition(",")
            if not filter_name or metric.endswith("_stderr") or not isinstance(value, (int, float)):
                continue
            suffix = "" if filter_name == "none" else f"_{filter_name}"
            scores[f"{task}_{metric}{suffix}"] = float(value)
    return scores


def build_harness(evaluation, seed: int = 0) -> Harness | None:
    """The recipe's harness (``evaluation.tasks``), None without tasks; lm-eval missing: a clear error."""
    if not evaluation.tasks:
        return None
    try:
        import lm_eval  # noqa: F401
    except ImportError as err:
        raise HfTuneError("evaluation.tasks needs lm-evaluation-harness: pip install 'hf_tune[eval]'") from err
    return Harness(evaluation.tasks, limit=evaluation.limit, num_fewshot=evaluation.num_fewshot,
                   batch_size=evaluation.batch_size, seed=seed,
                   apply_chat_template=evaluation.apply_chat_template)


def _is_yaml(task: str) -> bool:
    return task.endswith((".yaml", ".yml"))


@contextlib.contextmanager
def _quiet():
    """lm-eval logs every request batch at INFO: kept to warnings while it scores inside a training run."""
    loggers = [logging.getLogger(name) for name in ("lm_eval", "lm-eval")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(max(lg.level, logging.WARNING))
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
