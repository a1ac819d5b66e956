"""A chat template whose markers the tokenizer lacks (hf_tune/model/new_tokens.py): the markers become special tokens,
the embeddings grow, the new rows train (LoRA: trainable_token_indices; full fine-tune: every row) and the saved run
reloads with the same vocabulary."""

from __future__ import annotations

import logging

import pytest
import torch
from chat_templates import LLAMA3
from conftest import chat_recipe

from hf_tune import build_run, load_recipe

MARKERS = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


def llama3_recipe(model_dir, out, lora: dict | None) -> dict:
    raw = chat_recipe(model_dir, out, max_steps=3, learning_rate=5e-2, warmup_steps=0, weight_decay=0.0)
    raw["data"]["chat_template"] = LLAMA3
    if lora is not None:
        raw["lora"] = lora
    return raw


def embedding_rows(model, ids: list[int]) -> torch.Tensor:
    """The rows the model actually feeds forward (PEFT's trainable tokens included), read through its embedding."""
    with torch.no_grad():
        return model.get_input_embeddings()(torch.tensor(ids)).clone()


@pytest.mark.parametrize("lora", [{"r": 4, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0}, None],
                         ids=["lora", "full"])
def test_template_markers_become_trained_special_tokens(tmp_path, tiny_llama_dir, smol_tokenizer, caplog, lora):
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert all(len(smol_tokenizer(m, add_special_tokens=False)["input_ids"]) > 1 for m in MARKERS)  # split today
    vocabulary = len(smol_tokenizer)
    with caplog.at_level(logging.INFO, logger="hf_tune.model.new_tokens"):
        run = build_run(load_recipe(llama3_recipe(tiny_llama_dir, tmp_path / "run", lora)))
    tokenizer, model = run.tokenizer, run.model
    assert [len(tokenizer(m, add_special_tokens=False)["input_ids"]) for m in MARKERS] == [1, 1, 1]
    ids = tokenizer.convert_tokens_to_ids(MARKERS)
    assert sorted(ids) == list(range(vocabulary, vocabulary + 3)) and len(tokenizer) == vocabulary + 3
    assert model.get_input_embeddings().weight.shape[0] == vocabulary + 3
    lines = [r.getMessage() for r in caplog.records if "special tokens" in r.getMessage()]
    assert len(lines) == 1 and "added 3 special tokens" in lines[0]
    assert ("trainable_token_indices" if lora else "full fine-tune") in lines[0]
    row = run.data.train[0]["input_ids"]
    assert tokenizer.convert_tokens_to_ids("<|eot_id|>") in row  # the training data holds the markers as one token

    old = [5, 100, 2000]
    before_new, before_old = embedding_rows(model, ids), embedding_rows(model, old)
    run.trainer.train()
    run.trainer.save_model()
    after_new = embedding_rows(model, ids)
    assert all(not torch.equal(a, b) for a, b in zip(after_new, before_new))  # every new row moved
    if lora:
        assert torch.equal(embedding_rows(model, old), before_old)  # only the new rows train

    saved = AutoTokenizer.from_pretrained(tmp_path / "run")
    assert len(saved) == vocabulary + 3
    reloaded = (AutoPeftModelForCausalLM if lora else AutoModelForCausalLM).from_pretrained(tmp_path / "run")
    assert reloaded.get_input_embeddings().weight.shape[0] == len(saved)
    assert torch.allclose(embedding_rows(reloaded, ids), after_new, atol=1e-6, rtol=0)


def test_a_tokenizer_that_has_the_markers_gets_nothing_new(tmp_path, tiny_llama_dir, smol_tokenizer):
    raw = chat_recipe(tiny_llama_dir, tmp_path / "run")
    raw["data"]["chat_template"] = smol_tokenizer.chat_template  # ChatML: SmolLM2 has <|im_start|> and <|im_end|>
    run = build_run(load_recipe(raw))
    assert len(run.tokenizer) == len(smol_tokenizer) and run.tokenizer.hf_tune_new_tokens == []
