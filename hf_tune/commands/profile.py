"""``hf-tune profile RECIPE``: a short run of the profile section's steps under torch.profiler, its trace, top
operators and step-time shares (``workflows/profile.py``); the real run folder is not touched."""

from __future__ import annotations

from pathlib import Path

from hf_tune.commands.verb import Verb, option
from hf_tune.runtime.output_paths import Output


def run(args) -> None:
    from hf_tune.assembly.loading import load_recipe  # loads transformers: only when the verb runs
    from hf_tune.trainer.profiling import format_profile
    from hf_tune.workflows.profile import profile_recipe

    summary = profile_recipe(load_recipe(args.recipe, args.overrides), out=args.out)
    print(format_profile(summary, Path(summary["dir"])))


VERB = Verb(run, "a short run of the profile section's steps under torch.profiler: trace, top operators, step-time "
            "shares", True, (option("--out", default=None, help="folder of the profiled run (default: "
                                    "training.output_dir + -profile; the real run folder is not touched)"),),
            output=Output("folder"))
