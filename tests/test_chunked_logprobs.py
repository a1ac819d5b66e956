"""The chunked target log-probabilities (hf_tune.model.chunked_logprobs) equal log_softmax / cross_entropy on the full
logits, values and gradients, for any chunk size; and nothing of size positions x vocabulary is kept for backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hf_tune.model.chunked_logprobs import chunked_cross_entropy, chunked_target_logprobs

N, H, V = 29, 12, 97  # 29 positions: chunk sizes 4 and 8 leave a remainder


def inputs(dtype=torch.float32, ignored_every: int = 3, seed: int = 0, bias: bool = False):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=generator).to(dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=generator) / H ** 0.5).to(dtype).requires_grad_()
    targets = torch.randint(0, V, (N,), generator=generator)
    if ignored_every:
        targets[::ignored_every] = -100
    head_bias = torch.randn(V, generator=generator).to(dtype).requires_grad_() if bias else None
    return hidden, weight, targets, head_bias


def full_logits(hidden, weight, bias=None, logit_scale=1.0, softcap=None):
    """The head as the models write it: Linear, then Cohere's scale, then Gemma 2's tanh softcap."""
    logits = F.linear(hidden, weight, bias).float() * logit_scale
    return logits if softcap is None else softcap * torch.tanh(logits / softcap)


def grads(loss, *tensors):
    return torch.autograd.grad(loss, [t for t in tensors if t is not None])


@pytest.mark.parametrize("chunk_size", [1, 4, 8, N, 1000])
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_loss_and_gradients_equal_cross_entropy_on_full_logits(chunk_size, reduction):
    hidden, weight, targets, _ = inputs()
    expected = F.cross_entropy(full_logits(hidden, weight), targets, reduction=reduction, ignore_index=-100)
    expected_grads = grads(expected, hidden, weight)
    loss = chunked_cross_entropy(hidden, weight, targets, reduction=reduction, chunk_size=chunk_size)
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
    for got, want in zip(grads(loss, hidden, weight), expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert hidden.grad is None  # autograd.grad only: each parametrization builds its own tensors anyway


@pytest.mark.parametrize("chunk_size", [3, 16])
def test_per_token_logprobs_equal_log_softmax_with_batch_dims_bias_scale_and_softcap(chunk_size):
    hidden, weight, targets, bias = inputs(bias=True)
    hidden3d = hidden.reshape(1, N, H).expand(2, N, H)  # [B, T, H]; a non-contiguous view of a leaf
    targets3d = torch.stack([targets, targets.roll(1)])
    logprobs_all = F.log_softmax(full_logits(hidden3d, weight, bias, logit_scale=0.6, softcap=2.5), dim=-1)
    expected = logprobs_all.gather(-1, targets3d.clamp(min=0)[..., None]).squeeze(-1) * (targets3d != -100)
    got = chunked_target_logprobs(hidden3d, weight, targets3d, bias, chunk_size=chunk_size, logit_scale=0.6,
                                  softcap=2.5)
    assert got.shape == targets3d.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    upstream = torch.linspace(-1, 1, 2 * N).reshape(2, N)  # a weighted sum: every position's gradient differs
    for g, e in zip(grads((got * upstream).sum(), hidden, weight, bias),
                    grads((expected * upstream).sum(), hidden, weight, bias)):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)


def test_a_frozen_head_gets_no_gradient_and_the_hidden_states_still_do():
    hidden, weight, targets, _ = inputs()
    weight.requires_grad_(False)
    loss = chunked_cross_entropy(hidden, weight, targets, chunk_size=5)
    expected = F.cross_entropy(full_logits(hidden, weight), targets)
    torch.testing.assert_close(grads(loss, hidden)[0], grads(expected, hidden)[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("chunk_size", [3, 1000])
def test_a_frozen_head_with_bias_scale_and_softcap_gives_each_positions_own_gradient_without_recomputing(chunk_size):
    """With the head frozen (LoRA), the rows' gradient is computed in forward: a weighted sum over positions (every
    position's upstream gradient differs) still gets log_softmax's gradient, and backward projects nothing."""
    hidden, weight, targets, bias = inputs(bias=True)
    weight.requires_grad_(False), bias.requires_grad_(False)
    hidden3d = hidden.reshape(1, N, H).expand(2, N, H)
    targets3d = torch.stack([targets, targets.roll(1)])
    upstream = torch.linspace(-1, 1, 2 * N).reshape(2, N)
    logprobs_all = F.log_softmax(full_logits(hidden3d, weight, bias, logit_scale=0.6, softcap=2.5), dim=-1)
    expected = logprobs_all.gather(-1, targets3d.clamp(min=0)[..., None]).squeeze(-1) * (targets3d != -100)
    got = chunked_target_logprobs(hidden3d, weight, targets3d, bias, chunk_size=chunk_size, logit_scale=0.6,
                                  softcap=2.5)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads((got * upstream).sum(), hidden)[0],
                               grads((expected * upstream).sum(), hidden)[0], rtol=1e-5, atol=1e-6)
    saved = saved_for_backward(lambda: chunked_target_logprobs(hidden3d, weight, targets3d, bias,
                                                               chunk_size=chunk_size, softcap=2.5))
    assert saved and all(V not in shape for shape in saved)  # neither the head nor any logits: nothing to recompute


def test_all_positions_ignored_gives_zero_loss_and_zero_gradients():
    hidden, weight, targets, _ = inputs()
    targets = torch.full_like(targets, -100)
    for reduction in ("sum", "mean"):
        loss = chunked_cross_entropy(hidden, weight, targets, reduction=reduction, chunk_size=4)
        assert loss.item() == 0.0
        grad_hidden, grad_weight = grads(loss, hidden, weight)
        assert not grad_hidden.any() and not grad_weight.any()
    # the upstream sum agrees; its mean is NaN (0 / 0), which a batch without trained tokens must not add
    assert F.cross_entropy(full_logits(hidden, weight), targets, reduction="sum").item() == 0.0


def test_bfloat16_inputs_match_a_float32_reference_within_bfloat16_rounding():
    hidden, weight, targets, _ = inputs(torch.bfloat16)
    loss = chunked_cross_entropy(hidden, weight, targets, chunk_size=8)
    grad_hidden, grad_weight = grads(loss, hidden, weight)
    assert loss.dtype == torch.float32 and grad_hidden.dtype == grad_weight.dtype == torch.bfloat16
    hidden32, weight32 = (t.detach().float().requires_grad_() for t in (hidden, weight))
    expected = F.cross_entropy(full_logits(hidden32, weight32), targets)
    # Tolerance: bf16 keeps 8 bits of mantissa (relative 2^-8 = 0.4 %); logits are rounded once, and the gradients
    # of hidden states and weight once more after a bf16 product, so 1 % relative / 0.01 absolute is bf16's scale.
    torch.testing.assert_close(loss, expected, rtol=1e-2, atol=1e-2)
    for got, want in zip((grad_hidden, grad_weight), grads(expected, hidden32, weight32)):
        torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=1e-2)


def test_under_autocast_the_head_runs_in_autocast_dtype_like_the_models_lm_head():
    hidden, weight, targets, _ = inputs()  # float32 master weights, as Trainer's bf16 mixed precision keeps them
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = F.cross_entropy(F.linear(hidden, weight).float(), targets)
        loss = chunked_cross_entropy(hidden, weight, targets, chunk_size=4)
    got_grads, want_grads = grads(loss, hidden, weight), grads(expected, hidden, weight)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)  # same bf16 logits, then float32
    for got, want in zip(got_grads, want_grads):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=1e-2, atol=2e-3)  # bf16 products, summed in another order


def saved_for_backward(compute) -> list[torch.Size]:
    """Shapes of every tensor autograd keeps for the backward of ``compute()``."""
    shapes = []

    def pack(tensor):
        shapes.append(tensor.shape)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        compute()
    return shapes


def test_nothing_of_positions_times_vocabulary_is_saved_for_backward():
    hidden, weight, targets, _ = inputs(ignored_every=0)
    full_size = N * V
    unchunked = saved_for_backward(lambda: F.cross_entropy(full_logits(hidden, weight), targets))
    assert max(shape.numel() for shape in unchunked) >= full_size  # the check sees the full logits when they are kept
    chunked = saved_for_backward(lambda: chunked_cross_entropy(hidden, weight, targets, chunk_size=4))
    assert chunked and max(shape.numel() for shape in chunked) < full_size
    assert sum(shape.numel() for shape in chunked) <= 2 * N * H + V * H + 4 * N  # inputs, targets, one lse per row


@pytest.mark.parametrize("bad, message", [
    (dict(targets=torch.zeros(N - 1, dtype=torch.long)), "disagree"),
    (dict(weight=torch.zeros(V, H + 1)), "not \\[vocabulary"),
    (dict(chunk_size=-1), "chunk_size"),
    (dict(softcap=0.0), "softcap"),
])
def test_inconsistent_arguments_are_refused_with_the_reason(bad, message):
    hidden, weight, targets, _ = inputs()
    arguments = dict(hidden=hidden, weight=weight, targets=targets) | bad
    with pytest.raises(ValueError, match=message):
        chunked_target_logprobs(**arguments)
