"""The hardware's peak FLOP/s, the denominator of MFU: a GPU's data-sheet dense peak for the dtype
(``GPU_PEAK_TFLOPS``), a CPU's cores x clock x FLOPs per cycle of its widest vector FMA (``cpu_peak_flops``), and a
dense matmul peak measured once per CPU model or GPU and cached (``measured_peak_flops``)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import psutil
import torch

from hf_tune.model.embedded import cache_dir
from hf_tune.runtime.machine import cpu_name

# Dense (no sparsity) peak TFLOP/s from NVIDIA's data sheets: float32 (FMA), tf32 (tensor cores, used for float32
# matmuls when torch's float32 matmul precision is not "highest"), bfloat16 / float16 (tensor cores). Data sheets
# that give only sparse tensor-core figures (H100 NVL, H200, B200, GB200, Ada) are halved. Matched as a substring of
# torch.cuda.get_device_name() ("NVIDIA H100 80GB HBM3"), most specific name first (H100 PCIe before H100, GB200
# before B200, L40S and L40 before L4, A100 before A10).
GPU_PEAK_TFLOPS = (
    ("H100 PCIe", {"float32": 51.0, "tf32": 378.0, "bfloat16": 756.0, "float16": 756.0}),
    ("H100 NVL", {"float32": 60.0, "tf32": 417.5, "bfloat16": 835.5, "float16": 835.5}),
    ("H100", {"float32": 67.0, "tf32": 494.7, "bfloat16": 989.4, "float16": 989.4}),   # SXM
    ("H200 NVL", {"float32": 60.0, "tf32": 417.5, "bfloat16": 835.5, "float16": 835.5}),
    ("H200", {"float32": 67.0, "tf32": 494.7, "bfloat16": 989.4, "float16": 989.4}),   # SXM
    ("GB200", {"float32": 80.0, "tf32": 1250.0, "bfloat16": 2500.0, "float16": 2500.0}),  # NVL72, per GPU
    ("B200", {"float32": 75.0, "tf32": 1125.0, "bfloat16": 2250.0, "float16": 2250.0}),   # HGX, per GPU
    ("A100", {"float32": 19.5, "tf32": 156.0, "bfloat16": 312.0, "float16": 312.0}),
    ("L40S", {"float32": 91.6, "tf32": 183.0, "bfloat16": 362.05, "float16": 362.05}),
    ("L40", {"float32": 90.5, "tf32": 90.5, "bfloat16": 181.05, "float16": 181.05}),
    ("L4", {"float32": 30.3, "tf32": 60.0, "bfloat16": 121.0, "float16": 121.0}),
    # GeForce: tensor-core figures with FP32 accumulate (what torch's half-precision matmuls use), half the FP16-
    # accumulate ones
    ("RTX 4090", {"float32": 82.6, "tf32": 82.6, "bfloat16": 165.2, "float16": 165.2}),
    ("A10", {"float32": 31.2, "tf32": 62.5, "bfloat16": 125.0, "float16": 125.0}),
    ("V100", {"float32": 15.7, "float16": 125.0}),  # SXM2
    ("T4", {"float32": 8.1, "float16": 65.0}),
)


def gpu_peak_flops(name: str, dtype: torch.dtype, float32_precision: str = "highest") -> float | None:
    """The data-sheet dense peak of the GPU called ``name`` for matmuls in ``dtype``, or None when unknown."""
    kind = str(dtype).removeprefix("torch.")
    if kind == "float32" and float32_precision != "highest":
        kind = "tf32"
    for model, peaks in GPU_PEAK_TFLOPS:
        if model in name:
            return peaks[kind] * 1e12 if kind in peaks else None
    return None


def cpu_flops_per_cycle(flags: set[str], vendor: str, family: int | None, dtype: torch.dtype) -> int | None:
    """FLOPs one x86 core issues per cycle with its widest FMA, two FMA pipes assumed (an FMA counts 2 FLOPs):
    float32 AVX-512 64 (AMD before Zen 5 runs it on 256-bit pipes: 32), AVX2 + FMA 32, AVX 16, SSE 8; bfloat16 /
    float16 with AMX 1024, with AVX512-BF16 / -FP16 twice float32, else float32's. None off x86."""
    if "sse2" not in flags:
        return None
    if "avx512f" in flags:
        fp32 = 32 if vendor == "AuthenticAMD" and (family or 0) < 26 else 64
    elif "avx2" in flags and "fma" in flags:
        fp32 = 32
    elif "avx" in flags:
        fp32 = 16
    else:
        fp32 = 8
    if dtype == torch.bfloat16:
        return 1024 if "amx_bf16" in flags else 2 * fp32 if "avx512_bf16" in flags else fp32
    if dtype == torch.float16:
        return 1024 if "amx_fp16" in flags else 2 * fp32 if "avx512_fp16" in flags else fp32
    return fp32


def cpu_peak_flops(dtype: torch.dtype, threads: int) -> tuple[float, str] | None:
    """(FLOP/s, how it was computed) of this CPU: the cores the run uses (its threads, at most the physical
    cores) x the clock x FLOPs per cycle. The clock is the CPU's maximum frequency where the OS reports it, else the
    one in its model name, else the current one (a virtual machine's is often the nominal clock: boost can exceed
    it, so a measured matmul can then outrun this figure). None where a part is unknown."""
    fields = _cpuinfo()
    flags = set(fields.get("flags", "").split())
    family = int(fields["cpu family"]) if fields.get("cpu family", "").isdigit() else None
    per_cycle = cpu_flops_per_cycle(flags, fields.get("vendor_id", ""), family, dtype)
    ghz, source = _cpu_clock_ghz(fields)
    if per_cycle is None or ghz is None:
        return None
    cores = min(threads, psutil.cpu_count(logical=False) or threads)
    return cores * ghz * 1e9 * per_cycle, f"{cores} cores x {ghz:.2f} GHz ({source}) x {per_cycle} FLOPs/cycle"


def _cpuinfo() -> dict[str, str]:
    try:
        lines = Path("/proc/cpuinfo").read_text().split("\n\n")[0].splitlines()
    except OSError:
        return {}
    return {key.strip(): value.strip() for key, value in (line.split(":", 1) for line in lines if ":" in line)}


def _cpu_clock_ghz(fields: dict[str, str]) -> tuple[float | None, str]:
    try:
        return int(Path("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq").read_text()) / 1e6, "maximum"
    except (OSError, ValueError):
        pass
    named = re.search(r"@\s*([\d.]+)\s*GHz", fields.get("model name", ""))
    if named:
        return float(named.group(1)), "model name"
    try:
        return float(fields["cpu MHz"]) / 1000, "current"
    except (KeyError, ValueError):
        return None, ""


def theoretical_peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """The hardware's theoretical dense peak for this dtype (data sheet for GPUs, cores x clock x FLOPs/cycle for
    CPUs), or None when it is not known."""
    if device.type == "cuda":
        return gpu_peak_flops(torch.cuda.get_device_name(device), dtype, torch.get_float32_matmul_precision())
    if device.type == "cpu":
        peak = cpu_peak_flops(dtype, torch.get_num_threads())
        return peak[0] if peak else None
    return None


def measured_peak_flops(device: torch.device, dtype: torch.dtype) -> float:
    """Dense matmul FLOP/s of this device and dtype (with this many threads), measured once and cached."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = f"{cpu_name()}-{torch.get_num_threads()}threads"
    key = f"{name}/{dtype}"
    peak_cache = cache_dir() / "peak_flops.json"
    try:
        cache = json.loads(peak_cache.read_text())
    except (OSError, ValueError):
        cache = {}
    if key not in cache:
        n = 4096 if device.type == "cuda" else 1024
        # its own generator: the run's seeded one stays the training's (a draw here moved every later dropout mask)
        generator = torch.Generator(device=device).manual_seed(0)
        a = torch.randn(n, n, device=device, dtype=dtype, generator=generator)
        b = torch.randn(n, n, device=device, dtype=dtype, generator=generator)
        best, deadline = 0.0, time.perf_counter() + 3
        for rounds in range(20):  # the best of many: on a shared host one timing can be far slower than the next
            if rounds >= 5 and time.perf_counter() > deadline:  # a slow dtype (bf16 without AMX): 5 rounds will do
                break
            _sync(device)
            start = time.perf_counter()
            for _ in range(10):
                a @ b
            _sync(device)
            best = max(best, 10 * 2 * n**3 / (time.perf_counter() - start))
        cache[key] = best
        peak_cache.parent.mkdir(parents=True, exist_ok=True)
        peak_cache.write_text(json.dumps(cache, indent=1))
    return cache[key]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
