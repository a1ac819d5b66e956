"""``hf-tune eval``: lm-eval scores off the training process. A finished run, one complete checkpoint, or a model
folder is scored once; with ``watch`` each new complete checkpoint of a run is scored as it appears, so training
never waits for evaluation. A run's scores are appended to its ``eval_scores.jsonl`` (``hf-tune report`` plots
them beside the losses)."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from hf_tune import run_folder
from hf_tune.errors import HfTuneError, RecipeError
from hf_tune.evaluation.harness import build_harness
from hf_tune.model.embedded import embedded_model_path, is_embedded
from hf_tune.recipe.schema import EvaluationSection
from hf_tune.records.run_reader import open_run
from hf_tune.trainer.checkpoints import checkpoints, is_complete

logger = logging.getLogger(__name__)
WAIT_TO_APPEAR_S = 600.0  # --watch of a run folder not there yet: how long it may take to appear


def evaluation_of(run_dir: Path, tasks: list[str] | None = None, **options) -> EvaluationSection:
    """The tasks to score: ``tasks`` (and ``options``: limit, num_fewshot, batch_size, apply_chat_template) over the
    run's own ``evaluation`` section (its resolved ``recipe.yaml``)."""
    section = (open_run(run_dir).recipe(required=False).get("evaluation") or {}) if run_dir.is_dir() else {}
    section = {k: v for k, v in section.items() if k in ("tasks", "limit", "num_fewshot", "batch_size",
                                                          "apply_chat_template")}
    section.update({k: v for k, v in options.items() if v is not None})
    if tasks:
        section["tasks"] = tasks
    if not section.get("tasks"):
        raise HfTuneError(f"{run_dir}: no lm-eval tasks to score\n  fix: pass --tasks (e.g. --tasks "
                          "hf_tune_arithmetic), or train with evaluation.tasks in the recipe")
    return EvaluationSection(**section)


def score_folder(folder: Path, harness, device: str | None = None, dtype: str | None = None) -> dict[str, float]:
    """``eval_<task>_<metric>`` of the model (or adapter on its base) saved in ``folder``."""
    from hf_tune.workflows.inference import load_trained

    if folder.is_dir():
        model, tokenizer = load_trained(folder, device=device, dtype=dtype)
    else:  # a Hub id (or an embedded: name)
        model, tokenizer = _load_named(str(folder), device, dtype)
    return {f"eval_{name}": value for name, value in harness.score(model, tokenizer).items()}


def record(run_dir: Path, checkpoint: Path | None, scores: dict[str, float], seconds: float) -> dict:
    """One line of ``eval_scores.jsonl``: the step (of the checkpoint, or the run's last), the folder, the scores."""
    step = int(checkpoint.name.split("-")[-1]) if checkpoint is not None else _final_step(run_dir)
    line = {"step": step, "checkpoint": checkpoint.name if checkpoint is not None else None, "scores": scores,
            "seconds": round(seconds, 3)}
    if (run_dir / run_folder.RECIPE).is_file():  # a run folder, not a bare model or a Hub id
        with (run_dir / run_folder.WATCHED_SCORES).open("a") as file:
            file.write(json.dumps(line) + "\n")
    return line


def scored_checkpoints(run_dir: Path) -> set[str]:
    return {line.get("checkpoint") for line in open_run(run_dir).jsonl(run_folder.WATCHED_SCORES)}


def evaluate_run(run_dir: str | Path, checkpoint: int | None = None, watch: bool = False, interval: float = 10.0,
                 device: str | None = None, dtype: str | None = None, tasks: list[str] | None = None,
                 wait: float = WAIT_TO_APPEAR_S, **options) -> list[dict]:
    """Score a run (its final model), one complete checkpoint, or (``watch``) each complete checkpoint until the
    run is finished and every one is scored; a watched run folder that does not exist yet (the watcher started
    before the run) is waited for ``wait`` seconds. Returns the lines written."""

    run_dir = Path(run_dir)
    checked = False
    if watch and not run_dir.exists():
        if tasks:
            _check_tasks(tasks, from_flag=True)  # a mistyped task is said now, not once the run has started
            checked = True
        _wait_to_appear(run_dir, wait, interval)
    if watch or checkpoint is not None or run_dir.exists() or _looks_like_a_path(str(run_dir)):
        open_run(run_dir)  # a folder that does not exist is named now, not watched forever
    if watch and checkpoint is not None:
        raise HfTuneError("hf-tune eval: --checkpoint and --watch exclude each other\n  fix: pass one of them")
    section = evaluation_of(run_dir, tasks, **options)
    if not checked:
        _check_tasks(section.tasks, from_flag=bool(tasks))
    harness = build_harness(section)
    if watch:
        return watch_run(run_dir, harness, interval, device, dtype)
    folder = run_dir if checkpoint is None else run_dir / f"checkpoint-{checkpoint}"
    if checkpoint is not None and not is_complete(folder):
        raise HfTuneError(f"{folder}: not a complete checkpoint (no completeness marker, or files missing)\n  fix: "
                          f"pass one of {[p.name.split('-')[-1] for p in checkpoints(run_dir) if is_complete(p)]}")
    start = time.perf_counter()
    scores = score_folder(folder, harness, device, dtype)
    return [record(run_dir, None if checkpoint is None else folder, scores, time.perf_counter() - start)]


def watch_run(run_dir: Path, harness, interval: float, device: str | None, dtype: str | None) -> list[dict]:
    """Each complete checkpoint not scored yet, oldest first, polled every ``interval`` seconds until the run's
    manifest says it ended (``end_time``) and nothing is left; a checkpoint rotated away meanwhile is skipped."""
    written = []
    while True:
        finished = _finished(run_dir)  # read before listing: a checkpoint saved after it is still listed
        done = scored_checkpoints(run_dir)
        waiting = [p for p in checkpoints(run_dir) if p.name not in done and is_complete(p)]
        for checkpoint in waiting:
            start = time.perf_counter()
            try:
                scores = score_folder(checkpoint, harness, device, dtype)
            except Exception as err:  # noqa: BLE001
                if checkpoint.exists():
                    raise
                logger.warning("%s: rotated away (save_total_limit) before it was scored: %s", checkpoint.name, err)
                continue
            written.append(record(run_dir, checkpoint, scores, time.perf_counter() - start))
            print(json.dumps(written[-1]), flush=True)
        if finished and not waiting:
            return written
        if not waiting:
            time.sleep(interval)



def _load_named(name: str, device: str | None, dtype: str | None):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_tune.workflows.inference import default_device, default_dtype

    path = embedded_model_path(name) if is_embedded(name) else name
    device = device or default_device()
    dtype = dtype or default_dtype(device)
    model = AutoModelForCausalLM.from_pretrained(path, dtype="auto" if dtype == "auto" else getattr(torch, dtype))
    return model.to(device).eval(), AutoTokenizer.from_pretrained(path)


def _wait_to_appear(run_dir: Path, wait: float, interval: float) -> None:
    """A run folder that is not there yet: waited for ``wait`` seconds where its parent exists, refused at once where
    the parent does not (a mistyped path never appears)."""
    if run_dir.exists():
        return
    if not run_dir.parent.is_dir():
        raise HfTuneError(f"{run_dir}: no such folder, nor its parent {run_dir.parent}\n  fix: pass the "
                          "training.output_dir of a run")
    logger.info("waiting up to %g s for %s to appear (the run has not started yet)", wait, run_dir)
    deadline = time.monotonic() + wait
    while not run_dir.exists():
        if time.monotonic() >= deadline:
            raise HfTuneError(f"{run_dir}: did not appear within {wait:g} s\n  fix: start the run whose "
                              "training.output_dir it is, or pass --wait with more seconds")
        time.sleep(min(interval, 0.5))


def _check_tasks(tasks: list[str], from_flag: bool) -> None:
    """Every task is known and its examples can be read, before any model loads (the recipe's own tasks were
    checked when it trained; they are named by their recipe key, the flag's by ``--tasks``)."""
    from hf_tune.assembly.preflight import offline_reason
    from hf_tune.evaluation.task_sources import check_task_sources
    from hf_tune.runtime.network import hub_is_reachable

    try:
        check_task_sources(tasks, lambda: None if hub_is_reachable() else offline_reason())
    except RecipeError as err:
        if not from_flag:
            raise
        raise HfTuneError(f"--tasks: {err.problem}" + (f"\n  fix: {err.fix}" if err.fix else "")) from None


def _looks_like_a_path(name: str) -> bool:
    """A name that no Hub id or ``embedded:`` name can be: it starts with ``.``, ``/`` or ``~``, or has two ``/``."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1


def _finished(run_dir: Path) -> bool:
    try:
        return bool(json.loads((run_dir / run_folder.MANIFEST).read_text()).get("end_time"))
    except (OSError, ValueError):
        return False


def _final_step(run_dir: Path) -> int | None:
    try:
        return json.loads((run_dir / run_folder.TRAINER_STATE).read_text())["global_step"]
    except (OSError, ValueError, KeyError):
        return None
