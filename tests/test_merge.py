"""Merge by shard: the merged tensors equal W + scale * B @ A computed here from the saved files, shard by shard."""

from __future__ import annotations

import json
import logging
import math
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from huggingface_hub import constants
from safetensors.torch import load_file

from hf_tune.workflows.merge_run import MERGE_CHECK_TOLERANCE, merge

R, ALPHA = 4, 8
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_tiny_llama(folder: Path, tokenizer, tied: bool) -> Path:
    """A random 2-layer Llama saved in several safetensors shards (the embeddings alone fill one)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=tied)
    LlamaForCausalLM(config).save_pretrained(folder, max_shard_size="40KB")
    tokenizer.save_pretrained(folder)
    return folder


def lora_run(base: Path, run: Path, tokenizer, targets: list[str], **lora) -> Path:
    """A run folder holding a LoRA adapter of ``base`` whose every factor is random (PEFT starts B at zero)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(2)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base),
                           LoraConfig(task_type="CAUSAL_LM", r=R, lora_alpha=ALPHA, target_modules=targets, **lora))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0, 0.2)
    model.save_pretrained(run)
    tokenizer.save_pretrained(run)
    return run


def tensors_of(folder: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for shard in sorted(folder.glob("model*.safetensors")):
        tensors.update(load_file(shard))
    return tensors


def expected_merge(base: Path, run: Path, scale: float, transposed: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """float32 W + scale * B @ A for every adapted weight ((B @ A).T for embeddings and (in, out) layers), from the
    files alone; a tied output embedding that the adapter changes starts from the input embedding."""
    weights, adapter = tensors_of(base), load_file(run / "adapter_model.safetensors")
    merged = {name: w.float() for name, w in weights.items()}
    for key in adapter:
        if key.endswith(("lora_A.weight", "lora_embedding_A")):
            module = key.removeprefix("base_model.model.").rsplit(".lora_", 1)[0]
            b = adapter[key.replace("lora_A", "lora_B").replace("lora_embedding_A", "lora_embedding_B")]
            product = b @ adapter[key]
            if "embedding" in key or module.rsplit(".", 1)[-1] in transposed:
                product = product.T
            source = weights.get(f"{module}.weight", weights.get("model.embed_tokens.weight"))
            merged[f"{module}.weight"] = source.float() + scale * product
    return merged


@pytest.fixture(scope="module")
def untied_base(tmp_path_factory, smol_tokenizer) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("untied"), smol_tokenizer, tied=False)


@pytest.fixture(scope="module")
def tied_base(tmp_path_factory, smol_tokenizer) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tied"), smol_tokenizer, tied=True)


def test_each_shard_holds_base_plus_the_scaled_lora_product(untied_base, smol_tokenizer, tmp_path):
    run = lora_run(untied_base, tmp_path / "run", smol_tokenizer, ALL_LINEAR)
    result = merge(run, tmp_path / "merged", dtype="float32", check=True)
    base_shards = json.loads((untied_base / "model.safetensors.index.json").read_text())["weight_map"]
    index = json.loads((tmp_path / "merged" / "model.safetensors.index.json").read_text())
    assert result["streamed"]["shards"] == len(set(base_shards.values())) > 2
    assert set(index["weight_map"]) == set(base_shards)
    merged, expected = tensors_of(tmp_path / "merged"), expected_merge(untied_base, run, ALPHA / R)
    assert merged.keys() == expected.keys() and all(t.dtype == torch.float32 for t in merged.values())
    assert result["streamed"]["merged_tensors"] == 2 * len(ALL_LINEAR)
    for name, tensor in merged.items():
        assert torch.allclose(tensor, expected[name], atol=1e-6, rtol=0), name
    assert result["relative_diff"] <= MERGE_CHECK_TOLERANCE["float32"]


def test_rslora_merges_with_alpha_over_root_r_in_bfloat16(untied_base, smol_tokenizer, tmp_path):
    run = lora_run(untied_base, tmp_path / "run", smol_tokenizer, ["q_proj", "down_proj"], use_rslora=True)
    result = merge(run, tmp_path / "merged", dtype="bfloat16", check=True)
    merged, expected = tensors_of(tmp_path / "merged"), expected_merge(untied_base, run, ALPHA / math.sqrt(R))
    for name, tensor in merged.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, expected[name].to(torch.bfloat16)), name
    assert json.loads((tmp_path / "merged" / "config.json").read_text())["dtype"] == "bfloat16"
    assert result["relative_diff"] <= MERGE_CHECK_TOLERANCE["bfloat16"]


def test_lora_on_tied_embeddings_unties_them(tied_base, smol_tokenizer, tmp_path):
    """Base + adapter reads the input embeddings and lm_head apart: the merge writes both and unties them."""
    assert "lm_head.weight" not in tensors_of(tied_base)
    run = lora_run(tied_base, tmp_path / "run", smol_tokenizer, ["embed_tokens", "lm_head", "q_proj"])
    result = merge(run, tmp_path / "merged", check=True)
    merged, expected = tensors_of(tmp_path / "merged"), expected_merge(tied_base, run, ALPHA / R)
    assert merged.keys() == expected.keys() and "lm_head.weight" in merged and result["streamed"]
    for name, tensor in merged.items():
        assert torch.allclose(tensor, expected[name], atol=1e-6, rtol=0), name
    assert not torch.allclose(merged["lm_head.weight"], merged["model.embed_tokens.weight"])
    assert json.loads((tmp_path / "merged" / "config.json").read_text())["tie_word_embeddings"] is False
    assert result["streamed"]["untied_embeddings"] and result["relative_diff"] <= MERGE_CHECK_TOLERANCE["float32"]


def test_a_tied_model_whose_embeddings_the_adapter_leaves_stays_tied(tied_base, smol_tokenizer, tmp_path):
    run = lora_run(tied_base, tmp_path / "run", smol_tokenizer, ["q_proj", "v_proj"])
    result = merge(run, tmp_path / "merged", check=True)
    assert "lm_head.weight" not in tensors_of(tmp_path / "merged") and not result["streamed"]["untied_embeddings"]
    assert json.loads((tmp_path / "merged" / "config.json").read_text())["tie_word_embeddings"] is True


def test_fan_in_fan_out_layers_take_the_transposed_product(smol_tokenizer, tmp_path):
    """GPT-2's Conv1D stores its weight as (in, out): PEFT's delta there is (B @ A).T."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(3)
    config = GPT2Config(vocab_size=len(smol_tokenizer), n_embd=32, n_layer=2, n_head=4, n_positions=256,
                        tie_word_embeddings=False)
    GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2", max_shard_size="40KB")
    run = lora_run(tmp_path / "gpt2", tmp_path / "run", smol_tokenizer, ["c_attn", "c_fc"], fan_in_fan_out=True)
    result = merge(run, tmp_path / "merged", check=True)
    merged = tensors_of(tmp_path / "merged")
    expected = expected_merge(tmp_path / "gpt2", run, ALPHA / R, transposed=("c_attn", "c_fc"))
    for name, tensor in merged.items():
        assert torch.allclose(tensor, expected[name], atol=1e-6, rtol=0), name
    assert result["streamed"]["merged_tensors"] == 4 and result["relative_diff"] <= MERGE_CHECK_TOLERANCE["float32"]


def test_dora_falls_back_to_peft_naming_the_key(untied_base, smol_tokenizer, tmp_path, caplog):
    run = lora_run(untied_base, tmp_path / "run", smol_tokenizer, ["q_proj"], use_dora=True)
    with caplog.at_level(logging.WARNING, logger="hf_tune.workflows.hub"):
        result = merge(run, tmp_path / "merged", check=True)
    assert "streamed" not in result and "use_dora = True" in caplog.text
    assert result["relative_diff"] <= MERGE_CHECK_TOLERANCE["float32"]


def test_a_hub_base_streams_from_its_cached_snapshot(untied_base, smol_tokenizer, tmp_path, monkeypatch):
    """A base named by Hub id is read from huggingface_hub's cache (offline here), revision as the recipe says."""
    cache = tmp_path / "hub"
    snapshot = cache / "models--alice--tiny" / "snapshots" / ("a" * 40)
    shutil.copytree(untied_base, snapshot)
    (cache / "models--alice--tiny" / "refs").mkdir()
    (cache / "models--alice--tiny" / "refs" / "v1").write_text("a" * 40)
    run = lora_run(untied_base, tmp_path / "run", smol_tokenizer, ["o_proj"])
    adapter_config = json.loads((run / "adapter_config.json").read_text())
    (run / "adapter_config.json").write_text(json.dumps({**adapter_config, "base_model_name_or_path": "alice/tiny"}))
    model = {"pretrained_model_name_or_path": "alice/tiny", "revision": "v1", "cache_dir": str(cache)}
    (run / "recipe.yaml").write_text(yaml.safe_dump({"model": model}))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    result = merge(run, tmp_path / "merged")
    assert result["streamed"]["merged_tensors"] == 2
    merged, expected = tensors_of(tmp_path / "merged"), expected_merge(untied_base, run, ALPHA / R)
    assert all(torch.allclose(t, expected[name], atol=1e-6, rtol=0) for name, t in merged.items())
