"""``hf-tune reproduce RUN_DIR``: the run trained again from its folder alone, then compared with the original
(``workflows/reproduce.py``): the same weights and metrics, or what differs and what differed between the two runs
(a package version, a data file, the machine); exit 1 when they differ."""

from __future__ import annotations

from pathlib import Path

from hf_tune.commands.verb import RUN_DIR, Verb, option
from hf_tune.runtime.output_paths import Output
from hf_tune.workflows.reproduce import reproduce


def run(args) -> None:
    second, comparison = reproduce(args.run_dir, out=args.out, against=args.against)
    print(comparison.report(Path(args.run_dir), second))
    if not comparison.reproduced:
        raise SystemExit(1)


VERB = Verb(run, "train a finished run again from its folder alone and say whether its weights and metrics match, "
            "naming what differs (exit 1 when they do not)", options=(
                RUN_DIR, option("--out", default=None, help="the rerun's folder (default: RUN_DIR-reproduced)"),
                option("--against", default=None, metavar="RUN_DIR2", help="compare with this finished run instead "
                       "of training one (a rerun launched on several processes)")),
            output=Output("folder", inputs=("run_dir", "against")))
