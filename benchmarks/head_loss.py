"""LM head + cross-entropy: the plain path hf_tune uses against a chunked, fused linear + cross-entropy.

    python benchmarks/head_loss.py                    # SmolLM2's head (49,152 x 576), 600 trained positions
    python benchmarks/head_loss.py --positions 1024 --rounds 7

A fused loss (Liger's FusedLinearCrossEntropy, Apple's Cut Cross-Entropy) never holds the fp32 logits of every
position: it projects a chunk of positions, takes the log-sum-exp and writes that chunk's input gradient during the
forward pass. Both of those are GPU kernels; this measures the idea on this machine in plain torch (the head frozen,
as in a LoRA run), forward and backward, in interleaved rounds, and checks that every variant gives the plain loss and
input gradient; a plain loss on the transposed product (vocabulary x hidden times hidden x positions, which the BLAS
blocks faster on its own) is measured too. Reported: the median time per variant and its ratio to the plain path.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of ``hidden @ weight.T`` against ``targets``, computed ``chunk`` positions at a time.
    The input gradient is written during the forward pass, so no full logits tensor lives into the backward."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int) -> torch.Tensor:
        grad = torch.empty_like(hidden)
        total = hidden.new_zeros(())
        for start in range(0, hidden.shape[0], chunk):
            rows = slice(start, start + chunk)
            logits = hidden[rows] @ weight.T
            lse = torch.logsumexp(logits, dim=-1)
            total += (lse - logits.gather(1, targets[rows, None]).squeeze(1)).sum()
            probs = logits.sub_(lse[:, None]).exp_()  # softmax in place: d loss / d logits = softmax - one-hot
            probs.scatter_add_(1, targets[rows, None], probs.new_full((probs.shape[0], 1), -1.0))
            torch.mm(probs, weight, out=grad[rows])
        ctx.save_for_backward(grad)
        return total

    @staticmethod
    def backward(ctx, grad_output):
        (grad,) = ctx.saved_tensors
        return grad * grad_output, None, None, None


def plain(hidden, weight, targets):
    return F.cross_entropy(F.linear(hidden, weight), targets, reduction="sum")


def transposed(hidden, weight, targets):  # the same product as (V x d) @ (d x n): another blocking in the BLAS
    return F.cross_entropy((weight @ hidden.T).T, targets, reduction="sum")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--positions", type=int, default=600, help="trained positions in one step (default 600: "
                        "about what a 1,024-token pack of the throughput benchmark's chats trains)")
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    weight = torch.randn(args.vocab, args.hidden) * 0.02
    hidden = torch.randn(args.positions, args.hidden)
    targets = torch.randint(0, args.vocab, (args.positions,))
    variants = {"plain (hf_tune)": plain, "transposed product": transposed}
    for chunk in (128, 256):
        variants[f"fused, chunks of {chunk}"] = (
            lambda h, w, t, chunk=chunk: ChunkedLinearCrossEntropy.apply(h, w, t, chunk))

    def step(loss_fn):
        h = hidden.clone().requires_grad_()
        start = time.perf_counter()
        loss = loss_fn(h, weight, targets)
        loss.backward()
        return time.perf_counter() - start, loss.detach(), h.grad

    _, reference_loss, reference_grad = step(plain)
    for name, fn in variants.items():
        _, loss, grad = step(fn)
        torch.testing.assert_close(loss, reference_loss, rtol=1e-5, atol=1e-3, msg=f"{name}: another loss")
        torch.testing.assert_close(grad, reference_grad, rtol=1e-4, atol=1e-6, msg=f"{name}: another gradient")
    times = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, fn in variants.items():
            times[name].append(step(fn)[0])
    base = statistics.median(times["plain (hf_tune)"])
    logits_mb = args.positions * args.vocab * 4 / 2**20
    print(f"{args.positions} positions, head {args.vocab} x {args.hidden}, fp32, {args.threads} threads, "
          f"median of {args.rounds} interleaved rounds (forward + backward); full logits: {logits_mb:.0f} MiB")
    print("| variant | ms | time vs plain | every round, ms |\n|---|---|---|---|")
    for name, runs in times.items():
        median = statistics.median(runs)
        print(f"| {name} | {median * 1e3:.0f} | {median / base:.2f}x | "
              f"{', '.join(f'{r * 1e3:.0f}' for r in sorted(runs))} |")


if __name__ == "__main__":
    main()
