"""The machine a process runs on, as the run folder names it: the CPU's model."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path


def cpu_name() -> str:
    """The CPU's model name: a home folder shared by different machines must not share one cached peak."""
    if sys.platform == "darwin":
        try:
            return subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True,
                                  timeout=5).stdout.strip() or platform.machine()
        except (OSError, subprocess.SubprocessError):
            return platform.machine()
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/cpuinfo").read_text().splitlines() if ":" in line)
    except OSError:
        fields = {}
    fields = {key.strip(): value.strip() for key, value in fields.items()}
    arm = " ".join(fields[k] for k in ("CPU implementer", "CPU part") if k in fields)  # Arm cores name no model
    return (fields.get("model name") or fields.get("Hardware") or (f"{platform.machine()} {arm}" if arm else "")
            or platform.processor() or platform.machine() or "cpu")
