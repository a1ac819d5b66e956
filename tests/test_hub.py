"""Merge, model card and push, against a local HTTP stand-in for the Hub (the network boundary)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from conftest import REPO, SMOLLM2, chat_recipe
from fake_hub import FakeHub
from hf_tune import load_recipe, train
from hf_tune.errors import HfTuneError
from hf_tune.model_card import base_model_id

TOKEN = "hf_testTOKENabcdef123"
SECRET = "hf_SECRETinRECIPE987"


def hf_tune_cli(*args, endpoint: str, token: str | None = TOKEN):
    env = {k: v for k, v in os.environ.items() if k != "HF_TOKEN"}
    env.update(HF_ENDPOINT=endpoint, HF_HOME=str(Path(os.environ.get("TMPDIR", "/tmp")) / "hf_tune_test_home"))
    if token:
        env["HF_TOKEN"] = token
    return subprocess.run([str(Path(sys.executable).parent / "hf-tune"), *args], capture_output=True, text=True,
                          env=env, timeout=600, cwd=REPO)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, tiny_llama_dir) -> Path:
    out = tmp_path_factory.mktemp("hub") / "run"
    raw = chat_recipe(tiny_llama_dir, out, max_steps=2, save_strategy="steps", save_steps=1, hub_token=SECRET)
    raw["lora"] = {"r": 4, "target_modules": ["q_proj", "v_proj"]}
    raw["hub"] = {"license": "apache-2.0", "tags": ["demo"]}
    train(load_recipe(raw))
    return out


def front_matter(readme: bytes) -> dict:
    return yaml.safe_load(readme.decode().split("---")[1])


def test_push_uploads_adapter_card_and_redacted_recipe_without_secrets(lora_run):
    with FakeHub() as hub:
        result = hf_tune_cli("push", str(lora_run), "--repo-id", "alice/tiny-lora", "--private", "--revision", "exp1",
                             endpoint=hub.url)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "pushed:" in result.stdout
    spec = hub.repos["alice/tiny-lora"]
    assert spec.get("visibility") == "private" or spec.get("private") is True, spec
    assert hub.branches == [("alice/tiny-lora", "exp1")]
    assert len(hub.commits) == 1 and hub.commits[0]["revision"] == "exp1"
    files = hub.commits[0]["files"]
    assert {"adapter_model.safetensors", "adapter_config.json", "README.md", "recipe.yaml", "tokenizer.json",
            "chat_template.jinja"} <= files.keys()
    assert not any(p.startswith("checkpoint-") or p == "training_args.bin" for p in files)
    for path, content in files.items():
        assert SECRET.encode() not in content and TOKEN.encode() not in content, path
    assert files["adapter_model.safetensors"] == (lora_run / "adapter_model.safetensors").read_bytes()
    meta = front_matter(files["README.md"])
    assert hub.validated and hub.validated[0]["content"] == files["README.md"].decode()  # the card's YAML was checked
    assert meta["library_name"] == "peft" and meta["license"] == "apache-2.0"
    assert {"hf_tune", "lora", "demo"} <= set(meta["tags"]) and meta["pipeline_tag"] == "text-generation"
    body = files["README.md"].decode()
    assert "## Hyperparameters" in body and "| lora.r | 4 |" in body and "train_loss" in body
    assert "AutoPeftModelForCausalLM.from_pretrained('alice/tiny-lora')" in body
    assert yaml.safe_load(files["recipe.yaml"])["training"]["hub_token"] == "***"
    auth = {path.split("?")[0]: h.get("Authorization") or h.get("authorization") for _, path, h in hub.requests}
    assert auth["/api/models/alice/tiny-lora/commit/exp1"] == f"Bearer {TOKEN}", auth
    assert set(auth.values()) <= {f"Bearer {TOKEN}", None}  # the token travels only as the auth header


def test_a_failed_upload_says_how_to_retry_and_leaves_the_run_intact(lora_run):
    before = sorted(p.name for p in lora_run.iterdir())
    with FakeHub() as hub:
        hub.fail_commits = True
        result = hf_tune_cli("push", str(lora_run), "--repo-id", "alice/tiny-lora", endpoint=hub.url)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "intact" in result.stderr and f"hf-tune push {lora_run} --repo-id alice/tiny-lora" in result.stderr
    assert sorted(p.name for p in lora_run.iterdir()) == before


def test_push_without_a_token_fails_before_any_request(lora_run):
    with FakeHub() as hub:
        result = hf_tune_cli("push", str(lora_run), "--repo-id", "alice/x", endpoint=hub.url, token=None)
    assert result.returncode == 2 and "HF_TOKEN" in result.stderr
    assert hub.requests == []


def test_push_to_hub_in_the_recipe_is_checked_when_the_recipe_loads(tmp_path, tiny_llama_dir, monkeypatch):
    from hf_tune import hub

    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(hub.constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    raw = chat_recipe(tiny_llama_dir, tmp_path / "run", push_to_hub=True, hub_model_id="alice/x")
    with pytest.raises(HfTuneError, match="training.push_to_hub: .*no Hugging Face token"):
        load_recipe(raw)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setattr(hub.constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens: offline
    hub.hub_is_reachable.cache_clear()
    try:
        with pytest.raises(HfTuneError, match="training.push_to_hub: .*cannot be reached"):
            load_recipe(raw)
    finally:
        hub.hub_is_reachable.cache_clear()


def test_model_card_names_the_hub_id_of_an_embedded_base_model():
    assert base_model_id(SMOLLM2) == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert base_model_id("embedded:all-MiniLM-L6-v2") == "sentence-transformers/all-MiniLM-L6-v2"
    assert base_model_id("Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B"
    assert base_model_id("/models/local-folder") is None


@pytest.mark.slow
def test_merge_of_a_smollm2_lora_run_matches_base_plus_adapter(tmp_path):
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM, AutoTokenizer

    raw = chat_recipe(SMOLLM2, tmp_path / "run", max_steps=3, learning_rate=5e-3)
    raw["lora"] = {"r": 4, "target_modules": ["q_proj", "v_proj", "o_proj"]}
    train(load_recipe(raw))
    result = subprocess.run([str(Path(sys.executable).parent / "hf-tune"), "merge", str(tmp_path / "run"), "--check"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "check: max |Δ logit|" in result.stdout
    merged_dir = tmp_path / "run" / "merged"
    assert {"model.safetensors", "config.json", "tokenizer.json", "chat_template.jinja"} <= set(os.listdir(merged_dir))

    tokenizer = AutoTokenizer.from_pretrained(merged_dir)
    batch = tokenizer.apply_chat_template([{"role": "user", "content": "Name a planet."}], add_generation_prompt=True,
                                          return_tensors="pt", return_dict=True)
    with torch.no_grad():
        adapter = AutoPeftModelForCausalLM.from_pretrained(tmp_path / "run").eval()
        with_adapter = adapter(**batch).logits
        with adapter.disable_adapter():
            base = adapter(**batch).logits
        merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()(**batch).logits
    assert (with_adapter - base).abs().max() > 1e-3  # the adapter learned something to merge
    assert torch.allclose(merged, with_adapter, atol=1e-4, rtol=0)
