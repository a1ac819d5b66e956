"""The LoRA family through ``peft.LoraConfig``, verbatim (DoRA, rsLoRA, PiSSA / OLoRA / LoftQ init, modules_to_save,
layers_to_transform), and LoRA+ as an optimizer-group rule beside LLRD (hf_tune/optim/param_groups.py).

Each variant trains a tiny Llama (3 blocks, untied head) for a few steps: every trained tensor changes, the saved
adapter reloads onto the base to the same logits, and every trained parameter is in exactly one optimizer group
with the LR its depth gives: ``lr * decay ** (L + 1 - depth)`` (x ``loraplus_lr_ratio`` for LoRA B matrices).
"""

from __future__ import annotations

import re

import pytest
import torch
from conftest import chat_recipe

from hf_tune import build_run, load_recipe
from hf_tune.errors import HfTuneError

BASE_LR, DECAY, BLOCKS = 1e-2, 0.5, 3
TARGETS = ["q_proj", "v_proj", "down_proj"]


@pytest.fixture(scope="module")
def llama3_dir(tmp_path_factory, smol_tokenizer) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(smol_tokenizer), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=BLOCKS, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, pad_token_id=smol_tokenizer.pad_token_id,
                         eos_token_id=smol_tokenizer.eos_token_id, tie_word_embeddings=False)
    folder = tmp_path_factory.mktemp("llama3")
    LlamaForCausalLM(config).save_pretrained(folder)
    smol_tokenizer.save_pretrained(folder)
    return str(folder)


def expected_lr(name: str, loraplus: float | None = None) -> float:
    """Written out here: block i -> depth i + 1, embeddings 0, anything after the blocks L + 1."""
    block = re.search(r"\.layers\.(\d+)\.", name)
    depth = int(block.group(1)) + 1 if block else 0 if "embed_tokens" in name else BLOCKS + 1
    lr = BASE_LR * DECAY ** (BLOCKS + 1 - depth)
    if loraplus and re.search(r"\.lora_(embedding_)?B\.", name):
        lr *= loraplus
    return lr


VARIANTS = {
    "dora": {"use_dora": True},
    "rslora": {"use_rslora": True},
    "pissa": {"init_lora_weights": "pissa"},
    "olora": {"init_lora_weights": "olora"},
    "modules_to_save": {"modules_to_save": ["lm_head"]},
    "layers_to_transform": {"layers_to_transform": [0, 2], "layers_pattern": "layers"},
}


def train_variant(model_dir, out, lora: dict, loraplus: float | None = None):
    raw = chat_recipe(model_dir, out, max_steps=3, learning_rate=BASE_LR, warmup_steps=0, weight_decay=0.0)
    raw["lora"] = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": TARGETS, **lora}
    raw["optim"] = {"layerwise_lr_decay": DECAY, **({"loraplus_lr_ratio": loraplus} if loraplus else {})}
    run = build_run(load_recipe(raw))
    before = {n: p.detach().clone() for n, p in run.model.named_parameters() if p.requires_grad}
    run.trainer.train()
    run.trainer.save_model()
    return run, before


def check_groups(run, loraplus: float | None = None) -> None:
    trained = {id(p): n for n, p in run.model.named_parameters() if p.requires_grad}
    seen: dict[int, float] = {}
    for group in run.trainer.optimizer.param_groups:
        for p in group["params"]:
            assert id(p) not in seen, f"{trained.get(id(p))} is in two groups"
            seen[id(p)] = group.get("initial_lr", group["lr"])
    assert seen.keys() == trained.keys()
    for pid, name in trained.items():
        assert seen[pid] == pytest.approx(expected_lr(name, loraplus), rel=1e-12), name


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_each_lora_variant_trains_reloads_and_composes_with_llrd(tmp_path, llama3_dir, variant):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run, before = train_variant(llama3_dir, tmp_path / "run", VARIANTS[variant])
    after = {n: p.detach() for n, p in run.model.named_parameters() if p.requires_grad}
    assert after.keys() == before.keys()
    unchanged = [n for n in after if torch.equal(after[n], before[n])]
    assert not unchanged, unchanged
    check_groups(run)
    if variant == "dora":
        assert any("lora_magnitude_vector" in n for n in after)
    if variant == "modules_to_save":
        assert any("lm_head.modules_to_save" in n for n in after)
    if variant == "layers_to_transform":
        assert {int(re.search(r"layers\.(\d+)\.", n).group(1)) for n in after} == {0, 2}

    ids = torch.tensor([[1, 504, 3458, 282, 4649, 314, 2]])
    base = AutoModelForCausalLM.from_pretrained(llama3_dir)
    reloaded = PeftModel.from_pretrained(base, tmp_path / "run").eval()
    run.model.eval()
    with torch.no_grad():
        assert torch.allclose(reloaded(input_ids=ids).logits, run.model(input_ids=ids).logits, atol=1e-5, rtol=0)


LOFTQ = {"init_lora_weights": "loftq", "loftq_config": {"loftq_bits": 4, "loftq_iter": 1}}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="PEFT computes LoftQ's initialisation on CUDA or XPU")
def test_loftq_init_trains_and_reloads_on_a_gpu(tmp_path, llama3_dir):
    run, before = train_variant(llama3_dir, tmp_path / "run", LOFTQ)
    assert all(not torch.equal(p.detach(), before[n]) for n, p in run.model.named_parameters() if p.requires_grad)
    check_groups(run)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA or XPU")
def test_loftq_init_is_refused_at_load_without_a_gpu(tmp_path, llama3_dir):
    raw = chat_recipe(llama3_dir, tmp_path)
    raw["lora"] = {"r": 4, "target_modules": TARGETS, **LOFTQ}
    with pytest.raises(HfTuneError, match="^lora.init_lora_weights: loftq: .*CUDA or XPU"):
        load_recipe(raw)


def test_loraplus_scales_the_b_matrices_on_top_of_their_depth(tmp_path, llama3_dir):
    run, _ = train_variant(llama3_dir, tmp_path / "run", {}, loraplus=16.0)
    check_groups(run, loraplus=16.0)
    names = [n for n, p in run.model.named_parameters() if p.requires_grad]
    assert any(".lora_B." in n for n in names) and any(".lora_A." in n for n in names)


def test_loraplus_without_lora_is_refused(tmp_path, llama3_dir):
    raw = chat_recipe(llama3_dir, tmp_path)
    raw["optim"] = {"loraplus_lr_ratio": 16}
    with pytest.raises(HfTuneError, match="^optim.loraplus_lr_ratio: .*no lora"):
        load_recipe(raw)
