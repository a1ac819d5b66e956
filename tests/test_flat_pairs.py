"""Padding-free preference batches (hf_tune/model/flat_pairs.py): DPO's chosen and rejected sequences run as one
flattened row, checked against the model's own padded forward (its full logits, log-softmaxed here), and a DPO run
trains to the same losses padded or flattened."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from conftest import REPO
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM
from trl.trainer.utils import add_fused_lm_head

from hf_tune import load_recipe
from hf_tune.model import flat_pairs
from hf_tune.model.chunked_head import chunked_loss_head
from hf_tune.model.flat_pairs import check_flat_pairs, install_flat_pairs
from hf_tune.workflows.train import train


def padded_pairs(vocab: int, lengths: list[int], prompt: int = 3, seed: int = 0):
    """A right-padded batch of chosen rows then rejected rows (TRL's layout), prompt tokens unscored."""
    generator = torch.Generator().manual_seed(seed)
    longest = max(lengths)
    ids = torch.randint(1, vocab, (len(lengths), longest), generator=generator)
    mask = (torch.arange(longest)[None] < torch.tensor(lengths)[:, None]).long()
    ids = ids.masked_fill(mask == 0, 0)
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :prompt] = -100
    return ids, mask, labels


def reference_stats(model, ids, mask, labels):
    """Per-token log-probability, entropy, mean logit and top-1 of the next token, from the model's own padded
    forward and its full logits."""
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits.float()[:, :-1]
    scored = labels[:, 1:] != -100
    logprobs = torch.log_softmax(logits, -1)
    target = labels[:, 1:].clamp(min=0)[..., None]
    entropy = -(logprobs.exp() * logprobs).sum(-1)
    return {"log_probs": logprobs.gather(-1, target).squeeze(-1) * scored, "entropy": entropy * scored,
            "mean_logits": logits.mean(-1) * scored, "is_top1": (logits.argmax(-1) == target.squeeze(-1)) & scored}


def tiny_qwen3() -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                        max_position_embeddings=128, tie_word_embeddings=False))


@pytest.mark.parametrize("architecture", ["llama", "qwen3"])
@pytest.mark.parametrize("attention", ["sdpa_varlen", "sdpa"])
def test_flattened_pairs_give_the_padded_forwards_log_probabilities(architecture, attention, tiny_llama_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir) if architecture == "llama" else tiny_qwen3()
    model.set_attn_implementation(attention)
    vocab = model.config.vocab_size
    add_fused_lm_head(model, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
    install_flat_pairs(model, chunked_loss_head(model), example_boundaries=attention == "sdpa_varlen")
    ids, mask, labels = padded_pairs(vocab, [11, 5, 8, 3, 9, 6])
    expected = reference_stats(model, ids, mask, labels)
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    assert got.log_probs.shape == expected["log_probs"].shape
    for name in ("log_probs", "entropy", "mean_logits"):
        torch.testing.assert_close(getattr(got, name), expected[name], atol=2e-5, rtol=1e-5)
    assert torch.equal(got.is_top1, expected["is_top1"])


def test_flattened_pairs_give_the_padded_gradients_through_a_lora_model(tiny_llama_dir, monkeypatch):
    from peft import LoraConfig, get_peft_model

    base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    base.set_attn_implementation("sdpa_varlen")
    torch.manual_seed(1)
    model = get_peft_model(base, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    ids, mask, labels = padded_pairs(base.config.vocab_size, [10, 4, 7, 7])

    def gradients(flat: bool) -> dict[str, torch.Tensor]:
        model.zero_grad()
        if flat:
            logprobs = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True).log_probs
        else:  # the model's own logits, log-softmaxed
            logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, :-1]
            logprobs = torch.log_softmax(logits, -1).gather(-1, labels[:, 1:].clamp(min=0)[..., None]).squeeze(-1)
            logprobs = logprobs * (labels[:, 1:] != -100)
        weights = torch.arange(1.0, 1.0 + logprobs.shape[0])[:, None]  # each row its own weight, as DPO's loss
        (logprobs * weights).sum().backward()
        return {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}

    padded = gradients(flat=False)
    add_fused_lm_head(base)  # as TRL does: on the base, under the adapter
    install_flat_pairs(base, chunked_loss_head(base), example_boundaries=True)
    calls = spy_on_flat_forward(monkeypatch)
    flat = gradients(flat=True)
    assert calls == [1] and len(padded) == 28  # through the flattened forward; LoRA A and B of 14 linear layers
    for name, grad in padded.items():
        torch.testing.assert_close(flat[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_the_proof_fails_where_the_flattened_sequences_would_see_each_other(tiny_llama_dir, monkeypatch):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    model.set_attn_implementation("sdpa")
    add_fused_lm_head(model)
    head = chunked_loss_head(model)
    install_flat_pairs(model, head, example_boundaries=False)
    check_flat_pairs(model, head)  # restarting positions: transformers' SDPA masks each sequence apart
    # a flattening that loses the boundaries: every sequence would attend to those before it
    monkeypatch.setattr(flat_pairs, "flattened_inputs", lambda ids, mask, boundaries: {
        "input_ids": ids[mask.bool()][None], "use_cache": False})
    with pytest.raises(Exception, match="training.padding_free"):
        check_flat_pairs(model, head)


def spy_on_flat_forward(monkeypatch) -> list[int]:
    """A list that counts the calls of the flattened forward from now on (its one entry, once called)."""
    calls: list[int] = []
    original = flat_pairs.flat_pairs_forward

    def counted(*args, **kwargs):
        calls[:] = [calls[0] + 1] if calls else [1]
        return original(*args, **kwargs)

    monkeypatch.setattr(flat_pairs, "flat_pairs_forward", counted)
    return calls


def dpo_raw(model: str, out, **training) -> dict:
    raw = yaml.safe_load((REPO / "recipes" / "llm_dpo.yaml").read_text())
    raw["model"]["pretrained_model_name_or_path"] = model
    raw["data"]["train"]["path"] = str(REPO / raw["data"]["train"]["path"])
    raw["data"].pop("eval_split", None)
    for key in ("metric_for_best_model", "load_best_model_at_end", "greater_is_better"):
        raw["training"].pop(key, None)
    raw["training"].update(output_dir=str(out), max_steps=3, save_strategy="no", eval_strategy="no",
                           report_to="none", logging_steps=1, per_device_train_batch_size=4, **training)
    return raw


def test_a_dpo_run_trains_to_the_same_losses_flattened_or_padded(tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TUNE_CACHE", str(tmp_path / "cache"))  # each run its own reference pass
    runs, calls = {}, {}
    for name, training in (("flat", {}), ("padded", {"padding_free": False})):
        calls[name] = spy_on_flat_forward(monkeypatch)
        train(load_recipe(dpo_raw(tiny_llama_dir, tmp_path / name, **training)))
        manifest = json.loads((tmp_path / name / "run.json").read_text())
        history = json.loads((tmp_path / name / "trainer_state.json").read_text())["log_history"]
        runs[name] = (manifest["decisions"], [entry["loss"] for entry in history if "loss" in entry])
    assert runs["flat"][0]["padding_free"] is True and runs["flat"][0]["attention"] == "sdpa_varlen"
    assert runs["padded"][0]["padding_free"] is False
    # flattened: the proof, the reference pass (the recipe's 240 pairs, 4 a batch) and 3 training steps; padded: never
    assert calls == {"flat": [1 + 240 // 4 + 3], "padded": []}
    assert len(runs["flat"][1]) == 3
    assert runs["flat"][1][0] != runs["flat"][1][2]  # it trained
    assert runs["flat"][1] == pytest.approx(runs["padded"][1], abs=1e-4)
