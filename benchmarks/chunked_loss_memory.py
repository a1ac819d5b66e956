"""Peak memory and time of the LM-head loss + backward: full logits (hf_tune's ``causal_lm_loss`` path:
``F.cross_entropy(F.linear(h, W).float())``) against ``hf_tune.model.chunked_logprobs`` (issue 33).

    flock -x /tmp/hftune.lock .venv/bin/python benchmarks/chunked_loss_memory.py
    .venv/bin/python benchmarks/chunked_loss_memory.py --positions 4096 --hidden 576 --vocab 49152 128256 --repeats 2

Each variant runs in a fresh subprocess, so its peak is its own: on CUDA ``torch.cuda.max_memory_allocated``, on a
CPU the process's peak RSS (``resource.getrusage``); both reported over the memory held before the loss (hidden
states, head weight, targets). The head is trainable (a full fine-tune: the weight gradient is computed), every
position is trained, float32 on a CPU and bfloat16 on CUDA. Time: the median of ``--repeats`` loss + backward
after one warm-up, in the same subprocess; the ratio is chunked / full, measured side by side in one run.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

VARIANTS = ("full", "chunked")


def current_rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def measure(variant: str, positions: int, hidden_size: int, vocab: int, repeats: int, chunk_size: int | None) -> dict:
    """One variant in this process: peak memory of loss + backward over what was held before, and median seconds."""
    import torch
    import torch.nn.functional as F

    from hf_tune.model.chunked_logprobs import chunked_cross_entropy, default_chunk_size

    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    generator = torch.Generator(device).manual_seed(0)  # drawn where it is used: a 152k x 4k head in seconds on a GPU
    hidden = torch.randn(positions, hidden_size, generator=generator, device=device).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, hidden_size, generator=generator, device=device) * 0.02).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab, (positions,), generator=generator, device=device)

    def loss_and_backward() -> float:
        hidden.grad = weight.grad = None
        if variant == "full":
            loss = F.cross_entropy(F.linear(hidden, weight).float(), targets, reduction="sum")
        else:
            loss = chunked_cross_entropy(hidden, weight, targets, reduction="sum", chunk_size=chunk_size)
        loss.backward()
        return float(loss.detach())

    if cuda:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        before = current_rss_bytes()
    loss = loss_and_backward()  # the warm-up, measured for memory
    if cuda:
        torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        loss_and_backward()
        if cuda:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    return {"variant": variant, "vocab": vocab, "device": torch.cuda.get_device_name() if cuda else "cpu",
            "dtype": str(dtype).removeprefix("torch."), "threads": torch.get_num_threads(), "loss": loss,
            "peak_over_inputs_mib": (peak - before) / 2**20, "peak_mib": peak / 2**20,
            "median_s": statistics.median(seconds),
            "chunk_size": chunk_size or default_chunk_size(vocab) if variant == "chunked" else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--positions", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=576, help="SmolLM2-135M's hidden size")
    parser.add_argument("--vocab", type=int, nargs="+", default=[49152, 128256], help="SmolLM2's, Llama 3's")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--chunk-size", type=int, default=None, help="default: 128 MiB of float32 logits a chunk")
    parser.add_argument("--child", nargs=2, metavar=("VARIANT", "VOCAB"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        result = measure(args.child[0], args.positions, args.hidden, int(args.child[1]), args.repeats, args.chunk_size)
        print(json.dumps(result))
        return
    rows = []
    for vocab in args.vocab:
        for variant in VARIANTS:
            command = [sys.executable, __file__, "--child", variant, str(vocab), "--positions", str(args.positions),
                       "--hidden", str(args.hidden), "--repeats", str(args.repeats)]
            if args.chunk_size:
                command += ["--chunk-size", str(args.chunk_size)]
            output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
            rows.append(json.loads(output.strip().splitlines()[-1]))
            print(f"measured {variant} at vocabulary {vocab}: {rows[-1]}", file=sys.stderr, flush=True)
    print(f"{args.positions} positions, hidden {args.hidden}, {rows[0]['device']} {rows[0]['dtype']}, "
          f"{rows[0]['threads']} threads, head trainable, loss + backward\n")
    print("| vocabulary | variant | chunk | peak over inputs (MiB) | process peak (MiB) | median s | loss |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['vocab']} | {row['variant']} | {row['chunk_size'] or '-'} | {row['peak_over_inputs_mib']:.0f} | "
              f"{row['peak_mib']:.0f} | {row['median_s']:.2f} | {row['loss']:.6g} |")
    print()
    for vocab in args.vocab:
        full, chunked = (next(r for r in rows if r["vocab"] == vocab and r["variant"] == v) for v in VARIANTS)
        memory_ratio = chunked["peak_over_inputs_mib"] / full["peak_over_inputs_mib"]
        print(f"vocabulary {vocab}: memory chunked / full {memory_ratio:.3f}, "
              f"time chunked / full {chunked['median_s'] / full['median_s']:.2f}, "
              f"loss relative difference {abs(chunked['loss'] - full['loss']) / abs(full['loss']):.1e}")


if __name__ == "__main__":
    main()
