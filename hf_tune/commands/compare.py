"""``hf-tune compare RUN_DIR ...``: the runs' (or a study's trials') differing recipe keys and results as a table, and
their curves overlaid in one PNG (``search/compare.py``)."""

from __future__ import annotations

from hf_tune.commands.verb import Verb, option
from hf_tune.runtime.output_paths import Output, starts_with
from hf_tune.search.compare import collect_runs, comparison_table, format_table, plot_comparison


def run(args) -> None:
    runs = collect_runs(args.run_dirs)
    print(format_table(comparison_table(runs)))
    print(f"curves: {plot_comparison(runs, args.out)}")


VERB = Verb(run, "table of runs' differing recipe keys and results; their curves in one PNG", options=(
    option("run_dirs", nargs="+", metavar="RUN_DIR", help="run folders, or a search's study folder (its trials)"),
    option("--out", default="compare.png", help="the PNG of overlaid loss and eval curves")),
    output=Output("file", ours=starts_with(b"\x89PNG")))
