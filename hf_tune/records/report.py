"""Training report: curves from ``trainer_state.json`` as PNG files in the run folder (``hf-tune report RUN_DIR``)."""

from __future__ import annotations

from pathlib import Path

from hf_tune import run_folder
from hf_tune.records.run_reader import RunFolder, open_run


def series(history: list[dict], key: str) -> tuple[list[int], list[float]]:
    points = [(entry["step"], entry[key]) for entry in history if key in entry and "step" in entry]
    return [s for s, _ in points], [v for _, v in points]


def watched_scores(run_dir: str | Path | RunFolder) -> list[dict]:
    """The checkpoints' scores of ``hf-tune eval`` (``eval_scores.jsonl``) as log entries, each metric named
    ``<name> (checkpoint)`` beside the in-process ones."""
    run = run_dir if isinstance(run_dir, RunFolder) else open_run(run_dir)
    return [{"step": line["step"], **{f"{k} (checkpoint)": v for k, v in (line.get("scores") or {}).items()}}
            for line in run.jsonl(run_folder.WATCHED_SCORES) if line.get("step") is not None]


def write_report(run_dir: str | Path) -> list[Path]:
    """loss.png (train and eval loss), lr.png (Trainer's LR, lowest and highest group), eval_metrics.png (other eval
    metrics), when the history has them. Returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = open_run(run_dir)
    run_dir = run.path
    history = run.trainer_state()["log_history"] + watched_scores(run)
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
