"""``training.use_liger_kernel``: Liger's patched ``forward`` takes no [batch, positions] ``logits_to_keep`` mask
(``hidden_states[:, logits_to_keep, :]``: an H200 run failed on it), so hf_tune passes it none. Run where liger-kernel
is installed; on a CPU only the patched forward is applied (its RMSNorm, RoPE and SwiGLU kernels need a GPU:
tests/gpu/test_gpu_chunked_loss.py runs them), and the losses, training and evaluation, equal the plain run's."""

from __future__ import annotations

import math

import pytest
from conftest import chat_recipe

pytest.importorskip("liger_kernel")
FORWARD_ONLY = {"rope": False, "rms_norm": False, "swiglu": False, "fused_linear_cross_entropy": True}


@pytest.mark.parametrize("chunked_loss", [None, False])
def test_liger_forward_trains_and_evaluates_to_the_plain_losses(tmp_path, tiny_llama_dir, chunked_loss):
    from liger_kernel.transformers.model.llama import lce_forward

    from hf_tune import build_run, load_recipe

    def run(name: str, **training):
        raw = chat_recipe(tiny_llama_dir, tmp_path / name, max_steps=4, learning_rate=3e-3, eval_strategy="steps",
                          eval_steps=2, **training)
        raw["data"]["eval_split"] = 0.2
        raw["lora"] = {"r": 8, "lora_alpha": 16, "target_modules": "all-linear", "lora_dropout": 0.0}
        raw["model"]["chunked_loss"] = chunked_loss
        trainer = build_run(load_recipe(raw)).trainer
        trainer.train()
        return trainer, [(e.get("loss"), e.get("eval_loss")) for e in trainer.state.log_history
                         if "loss" in e or "eval_loss" in e]

    _, plain = run("plain")
    trainer, liger = run("liger", use_liger_kernel=True, liger_kernel_config=FORWARD_ONLY)
    assert trainer.model.get_base_model().forward.__func__ is lce_forward  # Liger's forward ran, not the model's
    assert len(liger) == len(plain) == 6  # 4 training losses, 2 evaluations
    for (loss, eval_loss), (plain_loss, plain_eval) in zip(liger, plain):
        for got, expected in ((loss, plain_loss), (eval_loss, plain_eval)):
            assert (got is None) == (expected is None)
            assert got is None or math.isclose(got, expected, rel_tol=1e-5), (liger, plain)
