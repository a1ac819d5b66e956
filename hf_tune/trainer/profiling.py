"""Profiling training steps with ``torch.profiler``: the recipe's ``profile`` section (``{wait: 1, warmup: 1,
active: 3}``) profiles those steps of a run, and ``hf-tune profile RECIPE`` (``workflows/profile.py``) does a short run
of just those steps into a folder of its own. Written into ``profile/``: a Chrome / Perfetto trace (open it in
https://ui.perfetto.dev), the top operators by self time, and the share of step time in matmuls, attention, the
optimizer and data loading."""

from __future__ import annotations

import csv
import json
import logging
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from hf_tune import run_folder
from hf_tune.recipe.schema import ProfileSection

logger = logging.getLogger(__name__)

MATMUL = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addmv", "aten::mv", "aten::dot",
          "aten::matmul", "aten::linear", "aten::_int_mm")
CATEGORIES = ("matmul", "attention", "optimizer", "data loading", "other")
TOP_OPS = 25


def category(event) -> str:
    """Which part of a step an operator's self time belongs to: the optimizer's step and the data loader's next
    batch by the range they run in; attention by its SDPA / attention operator (the matmuls inside it included);
    matmuls by name; the rest is other (elementwise, norms, copies, the loss, autograd bookkeeping)."""
    names = []
    while event is not None:
        names.append(event.name)
        event = event.cpu_parent
    if any(n.startswith("Optimizer.") for n in names):
        return "optimizer"
    if any(n.startswith("enumerate(DataLoader)") for n in names):
        return "data loading"
    if any("scaled_dot_product" in n or "attention" in n.lower() or "flash" in n.lower() for n in names):
        return "attention"
    return "matmul" if names[0] in MATMUL else "other"


def summarize_profile(prof, out_dir: Path) -> dict[str, Any]:
    """Write trace.json, top_ops.csv and profile.json from a finished profiler window; return the summary."""
    out_dir.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(out_dir / run_folder.PROFILE_TRACE))
    events = list(prof.events())
    device = any(e.self_device_time_total > 0 for e in events)

    def self_time(event) -> float:  # microseconds
        return event.self_device_time_total if device else event.self_cpu_time_total

    steps = [e for e in events if e.name.startswith("ProfilerStep")]  # "ProfilerStep#N" (torch may show "*")
    step_time = sum(e.time_range.elapsed_us() for e in steps) if not device else \
        sum(self_time(e) for e in events)
    shares = dict.fromkeys(CATEGORIES, 0.0)
    by_op: dict[str, list[float]] = {}
    for event in events:
        shares[category(event)] += self_time(event)
        calls_time = by_op.setdefault(event.name, [0, 0.0])
        calls_time[0] += 1
        calls_time[1] += self_time(event)
    total_self = sum(shares.values())
    ranked = sorted(by_op.items(), key=lambda kv: -kv[1][1])
    def row(name: str, calls: int, us: float) -> dict[str, Any]:
        return {"operator": name, "calls": calls, "self_ms": round(us / 1e3, 3),
                "share_of_step_time": round(us / step_time, 4) if step_time else None}

    rows = [row(name, calls, us) for name, (calls, us) in ranked[:TOP_OPS]]
    rest = ranked[TOP_OPS:]
    if rest:  # the last row adds up the others, so the column sums to the profiled time
        rows.append(row(f"({len(rest)} other operators)", sum(c for _, (c, _) in rest), sum(t for _, (_, t) in rest)))
    with (out_dir / run_folder.PROFILE_TOP_OPS).open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    summary = {
        "steps": len(steps),
        "time": "device (CUDA) self time" if device else "CPU self time",
        "step_time_ms": round(step_time / 1e3 / max(len(steps), 1), 3),
        "profiled_time_ms": round(step_time / 1e3, 3),
        "self_time_ms": round(total_self / 1e3, 3),
        "shares": {k: round(v / total_self, 4) if total_self else 0.0 for k, v in shares.items()},
        "trace": run_folder.PROFILE_TRACE,
        "top_ops": run_folder.PROFILE_TOP_OPS,
    }
    (out_dir / run_folder.PROFILE_SUMMARY).write_text(json.dumps(summary, indent=2))
    return summary


def format_profile(summary: dict[str, Any], out_dir: Path) -> str:
    lines = [f"{summary['steps']} profiled steps, {summary['step_time_ms']:.1f} ms per step ({summary['time']})",
             "share of step time: " + ", ".join(f"{k} {v:.0%}" for k, v in summary["shares"].items())]
    with (out_dir / run_folder.PROFILE_TOP_OPS).open() as f:
        rows = list(csv.DictReader(f))
    width = max(len(r["operator"]) for r in rows)
    lines.append(f"{'operator':<{width}}  {'calls':>6}  {'self ms':>9}  {'share':>6}")
    for r in rows[:15]:
        share = float(r["share_of_step_time"] or 0)
        lines.append(f"{r['operator']:<{width}}  {r['calls']:>6}  {float(r['self_ms']):>9.2f}  {share:>6.1%}")
    lines.append(f"trace: {out_dir / summary['trace']} (open in https://ui.perfetto.dev or chrome://tracing)")
    return "\n".join(lines)


class StepProfiler(TrainerCallback):
    """Runs ``torch.profiler`` over the section's wait / warmup / active training steps (main process only) and
    writes its outputs when the active steps end."""

    def __init__(self, section: ProfileSection, out_dir: Path):
        self.section, self.out_dir = section, Path(out_dir)
        self.prof = None
        self.summary: dict[str, Any] | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        import torch
        from torch.profiler import ProfilerActivity, profile, schedule

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        s = self.section
        self.prof = profile(activities=activities, schedule=schedule(wait=s.wait, warmup=s.warmup, active=s.active,
                                                                     repeat=1),
                            on_trace_ready=self._ready, record_shapes=s.record_shapes, with_stack=s.with_stack,
                            profile_memory=s.profile_memory)
        self.prof.start()

    def on_step_end(self, args, state, control, **kwargs):
        if self.prof is not None:
            self.prof.step()

    def on_train_end(self, args, state, control, **kwargs):
        if self.prof is not None:
            self.prof.stop()
            self.prof = None
            if self.summary is None:
                logger.warning("profile: the run ended after %d steps, before the %d profiled ones (wait %d, warmup "
                               "%d, active %d) were done: nothing written", state.global_step,
                               self.section.wait + self.section.warmup + self.section.active, self.section.wait,
                               self.section.warmup, self.section.active)

    def _ready(self, prof) -> None:
        self.summary = summarize_profile(prof, self.out_dir)
        logger.info("profile: %s", format_profile(self.summary, self.out_dir))


def profile_dir(run_dir: Path) -> Path:
    return Path(run_dir) / run_folder.PROFILE_DIR
