"""A run folder that travels: trained on a Hub model (the stand-in Hub at a pinned commit: the network boundary), its
adapter names the base by Hub id and revision, its README.md is hf_tune's own card, and a copy of the folder loads
on a machine with none of the training machine's caches, with PEFT's AutoPeftModelForCausalLM, hf_tune.load_model
and hf-tune chat, giving the trained model's logits and answer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import chat_recipe
from fake_dataset_hub import DatasetHub
from inputs import front_matter

from hf_tune import load_recipe, train

REPO_ID, SHA = "someorg/tiny-chat-base", "7" * 40


@pytest.fixture
def hub(monkeypatch, tmp_path, tiny_llama_dir):
    """The tiny Llama's files as the stand-in Hub's model repo at commit SHA; a Hub cache of this test's own."""
    import datasets
    from huggingface_hub import constants

    from hf_tune.runtime.network import hub_is_reachable

    files = {p.name: p.read_bytes() for p in Path(tiny_llama_dir).iterdir() if p.is_file()}
    with DatasetHub({}, models={REPO_ID: {"main": (SHA, files)}}) as fake:
        monkeypatch.setattr(constants, "ENDPOINT", fake.url)
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                            fake.url + "/{repo_id}/resolve/{revision}/{filename}")
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "training-machine" / "hub"))
        monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
        # transformers keeps one HfApi per process, bound to the endpoint of its first use: an earlier test's made it
        # for the real Hub, whose tree listing (a tokenizer's load) then retried ~46 s before giving up
        monkeypatch.setattr("transformers.utils.hub._hf_api", None)
        monkeypatch.setenv("HF_TUNE_CACHE", str(tmp_path / "training-machine" / "hf_tune"))
        hub_is_reachable.cache_clear()
        yield fake
    hub_is_reachable.cache_clear()


def test_a_copied_run_folder_loads_from_fresh_caches_with_peft_hf_tune_and_chat(tmp_path, hub, tiny_llama_dir,
                                                                              monkeypatch, capsys):
    from huggingface_hub import constants
    from peft import AutoPeftModelForCausalLM, PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_tune import load_model
    from hf_tune.commands.cli import main
    from hf_tune.workflows.inference import reply

    raw = chat_recipe(REPO_ID, tmp_path / "runs" / "tiny", max_steps=2, learning_rate=5e-2)
    raw["model"]["revision"] = SHA
    raw["lora"] = {"r": 4, "target_modules": ["q_proj", "v_proj"]}
    trainer = train(load_recipe(raw))
    run = tmp_path / "runs" / "tiny"

    adapter = json.loads((run / "adapter_config.json").read_text())
    assert (adapter["base_model_name_or_path"], adapter["revision"]) == (REPO_ID, SHA)
    card = (run / "README.md").read_text()
    assert "More Information Needed" not in card and front_matter(card.encode())["base_model"] == REPO_ID
    assert f"load_model({str(run)!r})" in card and "learning_rate | 0.05" in card  # hf_tune's card, not PEFT's

    copied = tmp_path / "another-machine" / "tiny"
    shutil.copytree(run, copied)
    shutil.rmtree(run)  # nothing of the training machine's folder is left to read
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "another-machine" / "hub"))
    monkeypatch.setenv("HF_TUNE_CACHE", str(tmp_path / "another-machine" / "hf_tune"))
    downloads = len([r for r in hub.requests if "/resolve/" in r[1]])

    tokenizer = AutoTokenizer.from_pretrained(copied)
    batch = tokenizer.apply_chat_template([{"role": "user", "content": "Where does this run come from?"}],
                                          add_generation_prompt=True, return_tensors="pt", return_dict=True)
    independent = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_llama_dir), copied).eval()
    with torch.no_grad():
        expected = trainer.model.eval()(**batch).logits
        assert torch.allclose(independent(**batch).logits, expected, atol=1e-5)  # the copy holds the trained adapter
        peft_model = AutoPeftModelForCausalLM.from_pretrained(copied).eval()
        assert len([r for r in hub.requests if "/resolve/" in r[1]]) > downloads  # the base came from the Hub again
        assert any(f"/{REPO_ID}/resolve/{SHA}/" in r[1] for r in hub.requests)  # at the pinned commit
        assert torch.allclose(peft_model(**batch).logits, expected, atol=1e-5)
        assert torch.allclose(load_model(copied).eval()(**batch).logits, expected, atol=1e-5)

    capsys.readouterr()
    main(["chat", str(copied), "--prompt", "Where does this run come from?", "--max-new-tokens", "6",
          "--device", "cpu", "--dtype", "float32"])
    answer = reply(peft_model, tokenizer, [{"role": "user", "content": "Where does this run come from?"}],
                   max_new_tokens=6)
    printed = capsys.readouterr().out.strip().splitlines()
    assert printed[-1].removeprefix("assistant:").strip() == answer.strip() and answer.strip(), printed
