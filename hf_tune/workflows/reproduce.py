"""Two finished runs of one recipe, compared: did the second reproduce the first, and where not, what differed
between them. Reproduced means the same final weights (every tensor, bit for bit) and the same training metrics;
what can explain a difference is read from both ``run.json`` files: package versions, data fingerprints, the seed,
the device, the CPU threads, the number of processes, the git commit, the CPU model, the launcher, the math
libraries' environment, the run's decisions; where none differs, the report names what ``run.json`` cannot see.
``reproduce(run_dir)`` (``hf-tune reproduce``) makes the second run from the first one's folder alone: its resolved
``recipe.yaml``, with the seed in it, on the CPU threads ``run.json`` recorded."""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field
from pathlib import Path

from hf_tune import run_folder
from hf_tune.errors import HfTuneError
from hf_tune.records.run_reader import RunFolder, open_run

logger = logging.getLogger(__name__)

# metrics of the machine and its clock, not of the training: never compared
TIMING_METRICS = ("runtime", "per_second", "mfu", "memory", "step_time")
# metrics of the last launch only (Trainer's train_loss averages the steps since the resume; hf_tune's token counts
# count them): compared only when neither run resumed, the logged losses of every step stand for them otherwise
LAUNCH_METRICS = ("train_loss", "train_tokens", "train_trained_tokens")
CONDITIONS = ("device", "cpu_threads", "world_size")  # run.json's fields that can change floating-point results


@dataclass
class Comparison:
    weights: list[str] = field(default_factory=list)  # what differs, one line each ([] : identical)
    metrics: list[str] = field(default_factory=list)
    losses: list[str] = field(default_factory=list)
    causes: list[str] = field(default_factory=list)  # what differed between the two runs' inputs and machines
    summary: dict[str, str] = field(default_factory=dict)  # what was compared, for the report

    @property
    def reproduced(self) -> bool:
        return not self.weights and not self.metrics

    def report(self, first: Path, second: Path) -> str:
        lines = [f"{second} against {first}:"]
        for what in ("weights", "metrics", "losses"):
            differences = getattr(self, what)
            lines += [f"  {what}: {self.summary[what]}"] if not differences else \
                [f"  {what}: differ"] + [f"    {line}" for line in differences]
        if self.causes:
            lines += ["  what differed between the runs:"] + [f"    {line}" for line in self.causes]
        elif self.reproduced:
            lines += ["  what differed between the runs: nothing of " + self.summary["causes"]]
        else:  # never "nothing" for a run that did not reproduce: name what run.json cannot see
            lines += ["  what differed between the runs: nothing that run.json records (" + self.summary["causes"]
                      + "); what it cannot record: a kernel that is not deterministic (torch's deterministic "
                      "algorithms were off), a file changed in place that the data fingerprints do not read (a "
                      "model's weights at a local path), or a library that drew from the run's random numbers"]
        lines.append("reproduced: yes" if self.reproduced else "reproduced: no")
        return "\n".join(lines)


def finished_run(run_dir: str | Path) -> RunFolder:
    """A run folder whose ``run.json`` says the run ended, with its weights."""
    run = open_run(run_dir, needs=("manifest", "recipe", "weights"))
    if not run.manifest().get("end_time"):
        raise HfTuneError(f"{run.path}: the run has not finished (run.json has no end_time)\n  fix: let it finish "
                          "(rerun its recipe to resume it), then reproduce it")
    return run


def compare_runs(first: str | Path, second: str | Path) -> Comparison:
    a, b = finished_run(first), finished_run(second)
    result = Comparison()
    result.weights, result.summary["weights"] = _weights(a.path, b.path)
    resumed = {run.path.name: run.manifest().get("resumed_from") for run in (a, b)
               if run.manifest().get("resumed_from")}
    result.metrics, result.summary["metrics"] = _metrics(a.manifest().get("metrics") or {},
                                                         b.manifest().get("metrics") or {}, resumed)
    result.losses, result.summary["losses"] = _losses(a, b)
    result.causes, result.summary["causes"] = _causes(a.manifest(), b.manifest())
    return result


def _weight_files(run_dir: Path) -> list[str]:
    return sorted(p.name for p in run_dir.glob("*.safetensors"))


def _weights(first: Path, second: Path) -> tuple[list[str], str]:
    from safetensors.torch import load_file

    files_a, files_b = _weight_files(first), _weight_files(second)
    if files_a != files_b:
        return [f"weight files: {', '.join(files_a) or 'none'} against {', '.join(files_b) or 'none'}"], ""
    tensors = differing = 0
    worst, worst_name = 0.0, ""
    lines = []
    for name in files_a:
        a, b = load_file(first / name), load_file(second / name)
        if set(a) != set(b):
            lines.append(f"{name}: tensors {sorted(set(a) ^ set(b))[:5]} are in one run only")
        for key in sorted(set(a) & set(b)):
            tensors += 1
            if a[key].shape != b[key].shape or a[key].dtype != b[key].dtype:
                differing += 1
                lines.append(f"{key}: {tuple(a[key].shape)} {a[key].dtype} against "
                             f"{tuple(b[key].shape)} {b[key].dtype}")
            elif not a[key].equal(b[key]):
                differing += 1
                gap = (a[key].double() - b[key].double()).abs().max().item()
                if gap >= worst:
                    worst, worst_name = gap, key
    if differing:
        lines.insert(0, f"{differing} of {tensors} tensors differ; the largest |difference| is {worst:.3g}, in "
                        f"{worst_name}" if worst_name else f"{differing} of {tensors} tensors differ")
    return lines, f"identical ({tensors} tensors in {', '.join(files_a)}, bit for bit)"


def _trained_metric(name: str) -> bool:
    return not any(part in name for part in TIMING_METRICS)


def _metrics(first: dict, second: dict, resumed: dict[str, str]) -> tuple[list[str], str]:
    names = sorted(n for n in set(first) | set(second) if _trained_metric(n) and not (resumed and n in LAUNCH_METRICS))
    lines = [f"{n}: {first.get(n, 'absent')} against {second.get(n, 'absent')}" for n in names
             if first.get(n) != second.get(n)]
    launch = "" if not resumed else (
        f"; {', '.join(LAUNCH_METRICS)} count the last launch only, and "
        f"{' and '.join(f'{name} resumed from {checkpoint}' for name, checkpoint in resumed.items())}: the losses "
        "of every step are compared instead")
    return lines, f"identical ({', '.join(names) or 'none'}; the timings are not compared{launch})"


def _losses(first: RunFolder, second: RunFolder) -> tuple[list[str], str]:
    def logged(run: RunFolder) -> dict[int, float]:
        history = run.trainer_state(required=False).get("log_history") or []
        return {row["step"]: row["loss"] for row in history if "loss" in row and "step" in row}

    a, b = logged(first), logged(second)
    for step in sorted(set(a) | set(b)):
        if a.get(step) != b.get(step):
            return [f"first at step {step}: {a.get(step, 'not logged')} against {b.get(step, 'not logged')}"], ""
    return [], f"identical at all {len(a)} logged steps"


def _causes(first: dict, second: dict) -> tuple[list[str], str]:
    lines = []
    packages_a, packages_b = first.get("packages") or {}, second.get("packages") or {}
    lines += [f"package {name}: {packages_a.get(name, 'absent')} against {packages_b.get(name, 'absent')}"
              for name in sorted(set(packages_a) | set(packages_b)) if packages_a.get(name) != packages_b.get(name)]
    data_a, data_b = first.get("datasets") or {}, second.get("datasets") or {}
    for name in sorted(set(data_a) | set(data_b)):
        one, other = data_a.get(name) or {}, data_b.get(name) or {}
        if one.get("fingerprint") != other.get("fingerprint"):
            lines.append(f"data {name}: fingerprint {one.get('fingerprint')} ({one.get('examples')} examples) against "
                         f"{other.get('fingerprint')} ({other.get('examples')} examples): the data or its "
                         "tokenization changed (a local file's fingerprint also changes when it is rewritten)")
    seed_a, seed_b = (m["recipe"].get("training", {}).get("seed", 42) for m in (first, second))
    if seed_a != seed_b:
        lines.append(f"training.seed: {seed_a} against {seed_b}")
    lines += [f"{key}: {first.get(key)} against {second.get(key)}" for key in CONDITIONS
              if first.get(key) != second.get(key)]
    commits = [(m.get("git") or {}).get("commit") for m in (first, second)]
    if commits[0] != commits[1]:
        lines.append(f"hf_tune's git commit: {commits[0]} against {commits[1]}")
    numbers_a, numbers_b = first.get("numerics") or {}, second.get("numerics") or {}
    for key in sorted(set(numbers_a) | set(numbers_b)):
        if key == "env":
            env_a, env_b = numbers_a.get("env") or {}, numbers_b.get("env") or {}
            lines += [f"environment {name}: {env_a.get(name, 'unset')} against {env_b.get(name, 'unset')}"
                      for name in sorted(set(env_a) | set(env_b)) if env_a.get(name) != env_b.get(name)]
        elif numbers_a.get(key) != numbers_b.get(key):
            lines.append(f"{key.replace('_', ' ')}: {numbers_a.get(key)} against {numbers_b.get(key)}")
    decided_a, decided_b = first.get("decisions") or {}, second.get("decisions") or {}
    lines += [f"decision {key}: {decided_a.get(key)} against {decided_b.get(key)}"
              for key in sorted(set(decided_a) | set(decided_b)) if key != "memory"
              and decided_a.get(key) != decided_b.get(key)]
    checked = (f"{len(packages_a)} package versions, {len(data_a)} data fingerprint(s), seed {seed_a}, "
               f"{first.get('device')}, {first.get('cpu_threads')} CPU thread(s), {first.get('world_size')} "
               f"process(es), the git commit, the CPU model, the launcher, {len(numbers_a.get('env') or {})} math "
               f"library variable(s), the run's decisions")
    return lines, checked

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
