"""Throughput: real tokens, trained tokens and examples per second, step time, peak memory and model FLOPs utilisation.

Tokens are counted from the batches themselves (real tokens only: a pad that equals eos is still told apart by the
attention mask, and a flattened batch has no pads), so the figures are right for padded, padding-free and packed
batches alike. Model FLOPs are the ones training needs: every linear layer and attention on the real tokens, the LM
head on the positions it projects, a backward pass that computes weight gradients only where weights train (so a
LoRA run counts about 4 FLOPs per parameter and token, a full fine-tune 6).

MFU divides them by the hardware's theoretical peak (``hf_tune.trainer.peak_flops``), the convention of published MFU
figures: a GPU's data-sheet dense peak for the dtype, a CPU's cores x clock x FLOPs per cycle of its widest vector FMA.
A dense matmul peak measured once per CPU model or GPU (cached) is kept as a second figure, ``mfu_measured_peak``: it
says how close the run came to what this host's matmuls reach, but it moves with the host's load (2-thread fp32 on one
kind of machine: 69 to 311 GFLOP/s), so only the first compares runs across hosts.
"""

from __future__ import annotations

import resource
import time
from dataclasses import dataclass

import torch
from torch import nn
from transformers import TrainerCallback

from hf_tune.model.loss import next_token_trained
from hf_tune.model.moe import moe_shape
from hf_tune.trainer.peak_flops import measured_peak_flops, theoretical_peak_flops


@dataclass
class ModelFlops:
    """What a model costs per token, read from its modules (so LoRA, tied heads and odd shapes count as they are)."""

    linear_params: int       # weights every token goes through (linear layers; a mixture of experts: its routers
                             # and the experts a token is sent to, k of E); LM head and adapters excluded
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
    moe = moe_shape(base)
    if moe is not None:  # fused expert tensors and routers are parameters, not linear layers: a token runs k experts
        linear += moe.active_routed_parameters + moe.router_parameters
        base_trains |= any(p.requires_grad for name, p in base.named_parameters()
                           if ".experts." in name and "lora_" not in name)
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
