"""TensorBoard, an entry of the tracker table (``hf_tune.catalog.trackers``): Trainer's ``TensorBoardCallback``
writes the metrics under ``runs/``; hf_tune adds the evaluation's samples as text, in a TensorBoard run of its own."""

from __future__ import annotations

import os
from pathlib import Path

from hf_tune.catalog.trackers import TRACKERS

SAMPLES_RUN = "samples"  # the TensorBoard run of the samples' text


def tensorboard_samples(args, rows: list[dict], path: Path, step: int) -> None:
    from torch.utils.tensorboard import SummaryWriter

    text = "\n\n".join(f"**{r['prompt']}**\n\n{r['completion']}" for r in rows)
    # beside Trainer's runs (TENSORBOARD_LOGGING_DIR, else output_dir/runs/<date_host>)
    root = os.environ.get("TENSORBOARD_LOGGING_DIR") or str(Path(args.output_dir) / TRACKERS["tensorboard"].logs)
    with SummaryWriter(log_dir=str(Path(root) / SAMPLES_RUN)) as writer:
        writer.add_text("eval/samples", text, global_step=step)
