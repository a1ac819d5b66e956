"""Throughput: real tokens, trained tokens and examples per second, step time, peak memory and model FLOPs utilisation.

Tokens are counted from the batches themselves (real tokens only: a pad that equals eos is still told apart by the
attention mask, and a flattened batch has no pads), so the figures are right for padded, padding-free and packed
batches alike. Model FLOPs are the ones training needs: every linear layer and attention on the real tokens, the LM
head on the positions it projects, a backward pass that computes weight gradients only where weights train (so a
LoRA run counts about 4 FLOPs per parameter and token, a full fine-tune 6).

MFU divides them by the hardware's theoretical peak, the convention of published MFU figures: a GPU's data-sheet
dense peak for the dtype (``GPU_PEAK_TFLOPS``), a CPU's cores x clock x FLOPs per cycle of its widest vector FMA
(``cpu_peak_flops``). A dense matmul peak measured once per CPU model or GPU (cached) is kept as a second figure,
``mfu_measured_peak``: it says how close the run came to what this host's matmuls reach, but it moves with the host's
load (2-thread fp32 on one kind of machine: 69 to 311 GFLOP/s), so only the first compares runs across hosts.
"""

from __future__ import annotations

import json
import platform
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import TrainerCallback

from hf_tune.data.loss import next_token_trained



@dataclass
class ModelFlops:
    """What a model costs per token, read from its modules (so LoRA, tied heads and odd shapes count as they are)."""

    linear_params: int       # weights of the linear layers every token goes through (LM head and adapters excluded)
    adapter_params: int      # LoRA A and B weights
    head_params: int         # LM head weights, applied at each projected position
    attention_width: int     # layers x heads x head_dim: the width of QK^T and PV
    causal: bool
    base_trains: bool        # the linear layers get weight gradients (full fine-tune)
    head_trains: bool

    def batch_flops(self, lengths: list[int], head_positions: int) -> float:
        """Training FLOPs (forward + backward) of examples with these lengths and this many projected positions."""
        tokens = sum(lengths)
        pairs = sum(n * (n + 1) // 2 if self.causal else n * n for n in lengths)
        attention = 2 * 2 * self.attention_width * pairs          # QK^T and PV; backward costs twice the forward
        linear = 2 * self.linear_params * tokens                   # forward; backward: input grads (+ weight grads)
        head = 2 * self.head_params * head_positions
        return (3 * attention + linear * (3 if self.base_trains else 2) + 3 * 2 * self.adapter_params * tokens
                + head * (3 if self.head_trains else 2))


def _numel(param: torch.Tensor) -> int:
    return getattr(param, "ds_numel", None) or param.numel()  # ZeRO-3 leaves an empty local shard


def model_flops(model: nn.Module, causal: bool) -> ModelFlops:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    head_ids = {id(p) for p in head.parameters()} if head is not None else set()
    linear = adapters = 0
    base_trains = False
    for name, module in base.named_modules():
        if not isinstance(module, nn.Linear) or module is head:
            continue
        weights = module.in_features * module.out_features  # a 4-bit layer's weight tensor holds packed bytes
        if "lora_" in name:
            adapters += weights
        else:
            linear += weights
            base_trains |= module.weight.requires_grad
    config = base.config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return ModelFlops(linear_params=linear, adapter_params=adapters,
                      head_params=sum(_numel(p) for p in head.parameters() if p.dim() == 2) if head else 0,
                      attention_width=config.num_hidden_layers * heads * head_dim, causal=causal,
                      base_trains=base_trains, head_trains=any(p.requires_grad for p in base.parameters()
                                                               if id(p) in head_ids))


@dataclass
class BatchCounts:
    tokens: int
    trained_tokens: int
    examples: int
    lengths: list[int]
    head_positions: int


def count_batch(inputs: dict) -> BatchCounts:
    """Real tokens, trained tokens (causal LM: positions whose next token has a label), examples and their lengths."""
    ids = inputs["input_ids"]
    if "position_ids" in inputs and "attention_mask" not in inputs:  # flattened: examples restart at position 0
        starts = (inputs["position_ids"].reshape(-1) == 0).nonzero().flatten().tolist() + [ids.numel()]
        lengths = [b - a for a, b in zip(starts, starts[1:])]
    elif "attention_mask" in inputs:
        lengths = inputs["attention_mask"].sum(dim=-1).tolist()
    else:
        lengths = [ids.shape[-1]] * ids.shape[0]
    labels = inputs.get("labels")
    trained = int(next_token_trained(labels).sum()) if labels is not None and labels.dim() == 2 else len(lengths)
    keep = inputs.get("logits_to_keep")
    head_positions = int(keep.sum()) if isinstance(keep, torch.Tensor) and keep.dtype == torch.bool else sum(lengths)
    return BatchCounts(sum(lengths), trained, len(lengths), lengths, head_positions)


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
    import psutil

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
    import re

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
    from hf_tune.model.embedded import cache_dir

    peak_cache = cache_dir() / "peak_flops.json"
    try:
        cache = json.loads(peak_cache.read_text())
    except (OSError, ValueError):
        cache = {}
    if key not in cache:
        n = 4096 if device.type == "cuda" else 1024
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
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


def cpu_name() -> str:
    """The CPU's model name: a home folder shared by different machines must not share one cached peak."""
    if sys.platform == "darwin":
        import subprocess

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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB: the process's peak RSS


class Throughput(TrainerCallback):
    """Counts what each training step processed (fed by ``HfTuneTrainer.training_step``) and times the steps: from
    the end of the previous step, log, evaluation or save to the end of this step, so data loading is included and
    evaluation is not."""

    def __init__(self, causal: bool):
        self.causal = causal
        self.flops: ModelFlops | None = None
        self.peak: float | None = None  # theoretical
        self.measured_peak: float | None = None
        self.window = self._zero()
        self.total = self._zero()
        self._mark = None

    @staticmethod
    def _zero() -> dict[str, float]:
        return {"tokens": 0, "trained_tokens": 0, "examples": 0, "flops": 0.0, "seconds": 0.0, "steps": 0}

    def add(self, inputs: dict) -> None:
        counts = count_batch(inputs)
        flops = self.flops.batch_flops(counts.lengths, counts.head_positions) if self.flops else 0.0
        for bucket in (self.window, self.total):
            bucket["tokens"] += counts.tokens
            bucket["trained_tokens"] += counts.trained_tokens
            bucket["examples"] += counts.examples
            bucket["flops"] += flops

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.flops = model_flops(model, self.causal) if model is not None else None
        dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else next(model.parameters()).dtype
        self.peak = theoretical_peak_flops(args.device, dtype)
        self.measured_peak = measured_peak_flops(args.device, dtype)
        self._mark = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        seconds = time.perf_counter() - self._mark
        for bucket in (self.window, self.total):
            bucket["seconds"] += seconds
            bucket["steps"] += 1
        self._mark = time.perf_counter()

    def _resume(self, *args, **kwargs):
        self._mark = time.perf_counter()

    on_log = on_evaluate = on_save = _resume

    def metrics(self, accelerator, final: bool) -> dict[str, float]:
        """Figures since the last call (or for the whole run when ``final``), summed over ranks; empty before any
        step. Every rank must call it at the same point: it reduces across processes."""
        bucket = self.total if final else self.window
        values = torch.tensor([bucket["tokens"], bucket["trained_tokens"], bucket["examples"], bucket["flops"],
                               float(peak_memory_bytes(accelerator.device))], dtype=torch.float64,
                              device=accelerator.device)
        summed = accelerator.reduce(values.clone(), "sum") if accelerator.num_processes > 1 else values
        peak_memory = (accelerator.gather(values[4:5]).max() if accelerator.num_processes > 1 else values[4]).item()
        if not final:
            self.window = self._zero()
        seconds, steps = bucket["seconds"], bucket["steps"]
        if not steps or seconds <= 0:
            return {}
        tokens, trained, examples, flops = summed[:4].tolist()
        prefix = "train_" if final else ""
        out = {f"{prefix}tokens_per_second": tokens / seconds,
               f"{prefix}trained_tokens_per_second": trained / seconds,
               f"{prefix}examples_per_second": examples / seconds,
               f"{prefix}step_time": seconds / steps,
               f"{prefix}peak_memory_gb": peak_memory / 2**30}
        if self.peak and flops:  # against the theoretical peak: the figure published MFUs mean
            out[f"{prefix}mfu"] = flops / seconds / (self.peak * accelerator.num_processes)
        if self.measured_peak and flops:  # against this host's measured matmul peak
            out[f"{prefix}mfu_measured_peak"] = flops / seconds / (self.measured_peak * accelerator.num_processes)
        if final:
            out.update(train_tokens=tokens, train_trained_tokens=trained)
        return out
