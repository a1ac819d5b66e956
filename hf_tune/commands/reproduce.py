"""``hf-tune reproduce RUN_DIR``: the run trained again from its folder alone (its resolved ``recipe.yaml``, with
the seed in it, on the CPU threads ``run.json`` recorded), then compared with the original
(``workflows/reproduce.py``): the same weights and metrics, or what differs and what differed between the two runs
(a package version, a data file, the machine)."""

from __future__ import annotations

import copy
import logging
from pathlib import Path

from hf_tune import run_folder
from hf_tune.errors import HfTuneError
from hf_tune.workflows.reproduce import Comparison, compare_runs, finished_run

logger = logging.getLogger(__name__)


def rerun_recipe(recipe: dict, out: Path) -> dict:
    """The run's recipe as the rerun trains it: into ``out``, from the first step, reporting to no tracker (a
    rerun is not a new experiment)."""
    recipe = copy.deepcopy(recipe)
    training = recipe.setdefault("training", {})
    training["output_dir"] = str(out)
    training.pop("resume_from_checkpoint", None)
    training["report_to"] = "none"
    recipe.pop("tracking", None)
    return recipe


def reproduce(run_dir: str | Path, out: str | Path | None = None, against: str | Path | None = None
              ) -> tuple[Path, Comparison]:
    """(the second run's folder, the comparison). ``against``: a finished run to compare with instead of training
    one (a rerun on several processes, launched by hand); else the run is trained again into ``out`` (default:
    RUN_DIR-reproduced)."""
    if out is not None and against is not None:
        raise HfTuneError("--out and --against: give one (--out trains the rerun there; --against compares with a "
                          "rerun already made)")
    run = finished_run(run_dir)
    if against is not None:
        return Path(against), compare_runs(run.path, against)
    manifest = run.manifest()
    out = Path(out) if out is not None else run.path.with_name(run.path.name + "-reproduced")
    itself = out.resolve() == run.path.resolve()
    if itself or (out / run_folder.MANIFEST).exists() or (out / run_folder.RECIPE).exists():
        raise HfTuneError(f"--out {out}: {'is the run itself' if itself else 'holds a run already'}\n  fix: pass "
                          f"another --out, or compare with that run: hf-tune reproduce {run.path} --against {out}")
    world = manifest.get("world_size") or 1
    if world > 1:
        raise HfTuneError(
            f"{run.path}: trained on {world} processes, and reproduce trains in this one process\n  fix: launch the "
            f"rerun as the original was (e.g. accelerate launch --num_processes {world} -m hf_tune.run RECIPE, with "
            f"RECIPE a copy of {run.path / run_folder.RECIPE} whose training.output_dir is {out}), then: hf-tune "
            f"reproduce {run.path} --against {out}")
    import torch

    from hf_tune.assembly.loading import load_recipe
    from hf_tune.workflows.train import train

    threads = manifest.get("cpu_threads")
    if threads and threads != torch.get_num_threads():
        logger.info("CPU threads: %d, as the run had (this process had %d)", threads, torch.get_num_threads())
        torch.set_num_threads(threads)
    train(load_recipe(rerun_recipe(run.recipe(), out)))
    return out, compare_runs(run.path, out)
