"""``hf-tune report RUN_DIR``: a run's loss, learning rates and eval metrics plotted into PNG files
(``records/report.py``)."""

from __future__ import annotations

from hf_tune.commands.verb import RUN_DIR, Verb
from hf_tune.records.report import write_report


def run(args) -> None:
    for path in write_report(args.run_dir):
        print(path)


VERB = Verb(run, "plot a run's loss, learning rates and eval metrics into PNG files", options=(RUN_DIR,))
