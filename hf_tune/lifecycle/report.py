"""Training report: curves from ``trainer_state.json`` as PNG files in the run folder (``hf-tune report RUN_DIR``)."""

from __future__ import annotations

import json
from pathlib import Path

from hf_tune.lifecycle import run_folder
from hf_tune.trainer.checkpoints import last_complete_checkpoint
from hf_tune.errors import HfTuneError


def series(history: list[dict], key: str) -> tuple[list[int], list[float]]:
    points = [(entry["step"], entry[key]) for entry in history if key in entry and "step" in entry]
    return [s for s, _ in points], [v for _, v in points]


def training_state(run_dir: Path) -> Path:
    """``trainer_state.json`` of a finished run, or of the newest complete checkpoint of a run in progress."""
    state = run_dir / run_folder.TRAINER_STATE
    if state.is_file():
        return state
    checkpoint = last_complete_checkpoint(run_dir)
    if checkpoint is None or not (checkpoint / run_folder.TRAINER_STATE).is_file():
        raise HfTuneError(f"{run_dir}: no trainer_state.json, and no complete checkpoint yet\n  fix: pass the "
                          "output_dir of a run (a run in progress is reported from its newest checkpoint)")
    return checkpoint / run_folder.TRAINER_STATE


def watched_scores(run_dir: Path) -> list[dict]:
    """The checkpoints' scores of ``hf-tune eval`` (``eval_scores.jsonl``) as log entries, each metric named
    ``<name> (checkpoint)`` beside the in-process ones."""
    path = run_dir / run_folder.WATCHED_SCORES
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    return [{"step": line["step"], **{f"{k} (checkpoint)": v for k, v in line["scores"].items()}}
            for line in lines if line.get("step") is not None]


def write_report(run_dir: str | Path) -> list[Path]:
    """loss.png (train and eval loss), lr.png (Trainer's LR, lowest and highest group), eval_metrics.png (other eval
    metrics), when the history has them. Returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    history = json.loads(training_state(run_dir).read_text())["log_history"] + watched_scores(run_dir)
    eval_keys = sorted({k for e in history for k in e if k.startswith("eval_") and k not in (
        "eval_loss", "eval_runtime", "eval_samples_per_second", "eval_steps_per_second", "eval_downstream_runtime")})
    figures = {
        run_folder.LOSS_PLOT: (["loss", "eval_loss"], "loss"),
        run_folder.LR_PLOT: (["learning_rate", "lr_min", "lr_max"], "learning rate"),
        run_folder.EVAL_METRICS_PLOT: (eval_keys, "value"),
    }
    written = []
    for name, (keys, ylabel) in figures.items():
        drawn = [(key, *series(history, key)) for key in keys]
        drawn = [d for d in drawn if d[1]]
        if not drawn:
            continue
        fig, ax = plt.subplots(figsize=(8, 4.5))
        for key, steps, values in drawn:
            ax.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3, label=key)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{run_dir.name}: {name.removesuffix('.png').replace('_', ' ')}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(run_dir / name, dpi=100)
        plt.close(fig)
        written.append(run_dir / name)
    return written
