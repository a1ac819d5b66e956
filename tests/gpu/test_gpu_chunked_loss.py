"""The chunked loss on a CUDA GPU: in bf16 it equals cross-entropy on the full logits (values and gradients, within
bf16's rounding), and a LoRA run with ``model.chunked_loss`` or with Liger's kernels (``training.use_liger_kernel``)
trains to the same losses as the plain run."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import chat_recipe

pytestmark = pytest.mark.gpu


def test_bf16_chunked_cross_entropy_equals_the_full_logits_on_cuda():
    from hf_tune.model.chunked_logprobs import chunked_cross_entropy

    generator = torch.Generator("cuda").manual_seed(0)
    positions, hidden_size, vocab = 3000, 256, 32000  # 3,000 positions: several chunks of 1,048 and a remainder
    hidden = torch.randn(positions, hidden_size, generator=generator, device="cuda").bfloat16().requires_grad_()
    weight = (torch.randn(vocab, hidden_size, generator=generator, device="cuda") * 0.05).bfloat16().requires_grad_()
    targets = torch.randint(0, vocab, (positions,), generator=generator, device="cuda")
    targets[::5] = -100
    # the reference: the head in bf16 as the model's lm_head runs it, softmax in float32 (causal_lm_loss's path)
    expected = F.cross_entropy(F.linear(hidden, weight).float(), targets, reduction="sum")
    expected_grads = torch.autograd.grad(expected, (hidden, weight))
    got = chunked_cross_entropy(hidden, weight, targets, reduction="sum", chunk_size=1048)
    got_grads = torch.autograd.grad(got, (hidden, weight))
    assert math.isclose(float(got), float(expected), rel_tol=1e-5)
    for g, e in zip(got_grads, expected_grads):  # both rounded to bf16 once from float32 sums: a few bf16 units apart
        assert torch.allclose(g.float(), e.float(), rtol=2 ** -6, atol=float(e.float().abs().max()) * 2 ** -7)


@pytest.mark.parametrize("switch", ["chunked_loss", "use_liger_kernel"])
def test_a_lora_run_with_the_switch_matches_the_plain_run(tmp_path, tiny_llama_dir, switch):
    if switch == "use_liger_kernel":
        pytest.importorskip("liger_kernel")
    from hf_tune import build_run, load_recipe

    def losses(name: str, **changes) -> list[float]:
        raw = chat_recipe(tiny_llama_dir, tmp_path / name, max_steps=8, learning_rate=3e-3)
        raw["lora"] = {"r": 8, "lora_alpha": 16, "target_modules": "all-linear", "lora_dropout": 0.0}
        raw["model"]["chunked_loss"] = changes.pop("chunked_loss", False)
        raw["training"].update(changes)
        trainer = build_run(load_recipe(raw)).trainer
        trainer.train()
        return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]

    plain = losses("plain")
    switched = losses(switch, **{switch: True})
    assert len(switched) == len(plain) == 8 and all(math.isfinite(x) for x in switched)
    # bf16 kernels round differently from the plain path: the same losses to bf16's few parts in a thousand
    assert all(math.isclose(a, b, rel_tol=2e-2) for a, b in zip(switched, plain)), (switched, plain)
