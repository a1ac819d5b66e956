"""``model.chunked_loss``: SFT computes its loss from the last hidden state and the LM head in chunks, with the same
losses and gradients as the full logits, proven on the model before training, and refused where it cannot apply."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import DATA, chat_recipe
from transformers import (
    CohereConfig,
    CohereForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    GraniteConfig,
    GraniteForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaModel,
)

from hf_tune import build_run, load_recipe
from hf_tune.errors import RecipeError
from hf_tune.model.chunked_head import chunked_loss_head, default_chunked_loss_head, hidden_state_inputs
from hf_tune.model.loss import ChunkedCausalLMLoss, causal_lm_loss

SMALL = dict(vocab_size=101, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
             num_key_value_heads=1, head_dim=8)


class DoubledLogitsLlama(LlamaForCausalLM):
    """A model whose forward does more to the logits than the head the chunked loss reads."""

    def forward(self, *args, logits_to_keep=0, **kwargs):
        outputs = super().forward(*args, logits_to_keep=logits_to_keep, **kwargs)
        outputs.logits = outputs.logits * 2
        return outputs


def head_rows_projected(model) -> list[int]:
    """Records how many positions each forward projects onto the vocabulary (the LM head's input rows)."""
    rows = []
    head = (model.get_base_model() if hasattr(model, "get_base_model") else model).get_output_embeddings()
    head.register_forward_hook(lambda module, args, output: rows.append(args[0][..., 0].numel()))
    return rows


def trained_run(tiny_llama_dir, tmp_path, chunked: bool | None, lora: bool):
    raw = chat_recipe(tiny_llama_dir, tmp_path / f"run-{chunked}-{lora}", max_steps=3, learning_rate=5e-3,
                      max_grad_norm=1e6)  # no clipping: the logged grad_norm is the raw gradient's
    if chunked is not None:
        raw["model"]["chunked_loss"] = chunked
    if lora:
        raw["lora"] = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": "all-linear"}
    run = build_run(load_recipe(raw))
    rows = head_rows_projected(run.model)
    run.trainer.train()
    logs = [entry for entry in run.trainer.state.log_history if "loss" in entry]
    return run, [entry["loss"] for entry in logs], [entry["grad_norm"] for entry in logs], rows


@pytest.mark.parametrize("lora", [False, True], ids=["full fine-tune, tied head trained", "LoRA, frozen head"])
def test_sft_steps_with_the_chunked_loss_log_the_losses_and_gradients_of_the_full_logits(tiny_llama_dir, tmp_path,
                                                                                         lora):
    _, full_losses, full_norms, full_rows = trained_run(tiny_llama_dir, tmp_path, chunked=False, lora=lora)
    run, losses, norms, rows = trained_run(tiny_llama_dir, tmp_path, chunked=True, lora=lora)
    assert isinstance(run.trainer.compute_loss_func, ChunkedCausalLMLoss)
    # training projected one position a row (logits_to_keep=1; a batch is at most 2 rows), not the trained positions
    assert len(losses) == 3 and max(full_rows) > 2 and max(rows[-3:]) <= 2
    assert losses == pytest.approx(full_losses, rel=1e-5)  # step 2 and 3 follow from step 1's gradients
    assert norms == pytest.approx(full_norms, rel=1e-4)


def test_lora_sft_runs_the_chunked_loss_by_default_with_the_losses_and_gradients_of_the_full_logits(tiny_llama_dir,
                                                                                                    tmp_path):
    _, full_losses, full_norms, _ = trained_run(tiny_llama_dir, tmp_path, chunked=False, lora=True)
    run, losses, norms, rows = trained_run(tiny_llama_dir, tmp_path, chunked=None, lora=True)
    assert isinstance(run.trainer.compute_loss_func, ChunkedCausalLMLoss) and max(rows[-3:]) <= 2
    assert losses == pytest.approx(full_losses, rel=1e-5)
    assert norms == pytest.approx(full_norms, rel=1e-4)


def test_by_default_a_trained_head_keeps_the_full_logits_and_says_why(tiny_llama_dir, tmp_path, caplog):
    raw = chat_recipe(tiny_llama_dir, tmp_path / "run")  # a full fine-tune: the tied head trains
    with caplog.at_level("INFO", logger="hf_tune.model.chunked_head"):
        run = build_run(load_recipe(raw))
    assert run.trainer.compute_loss_func is causal_lm_loss
    assert "model.chunked_loss: off" in caplog.text and "LM head trains" in caplog.text


@pytest.mark.parametrize("model_class, change, reason", [
    (DoubledLogitsLlama, {}, "not its LM head applied to its last hidden state"),
    (LlamaForCausalLM, {"logits_to_keep": "all"}, "logits_to_keep is 'all'"),
], ids=["the probe fails", "all logits asked for"])
def test_by_default_a_model_or_recipe_the_chunked_loss_cannot_serve_falls_back_with_a_log_line(
        tiny_llama_dir, tmp_path, caplog, model_class, change, reason):
    raw = chat_recipe(tiny_llama_dir, tmp_path / "run")
    raw["model"].update(change)
    model = model_class(LlamaConfig(**SMALL)).requires_grad_(False)  # a frozen head, as under LoRA
    with caplog.at_level("INFO", logger="hf_tune.model.chunked_head"):
        assert default_chunked_loss_head(load_recipe(raw), model) is None
    assert "model.chunked_loss: off" in caplog.text and reason in caplog.text
    assert default_chunked_loss_head(load_recipe(chat_recipe(tiny_llama_dir, tmp_path / "run")),
                                     LlamaForCausalLM(LlamaConfig(**SMALL)).requires_grad_(False)) is not None


def test_the_chunked_training_loss_and_gradients_equal_cross_entropy_on_the_models_full_logits(tiny_llama_dir,
                                                                                               tmp_path):
    raw = chat_recipe(tiny_llama_dir, tmp_path / "run")
    raw["model"]["chunked_loss"] = True
    run = build_run(load_recipe(raw))
    model, trainer = run.model.train(), run.trainer
    batch = trainer.data_collator([run.data.train[i] for i in range(4)])
    trainer.compute_loss(model, dict(batch)).backward()
    got = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    forward = {k: v for k, v in batch.items() if k not in ("labels", "logits_to_keep")}
    logits = model(**forward).logits  # every position projected: [1, tokens, vocabulary]
    labels = batch["labels"]
    expected = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
    expected.backward()
    assert logits.shape[-1] == model.config.vocab_size and (labels[:, 1:] != -100).sum() > 10
    loss = trainer.compute_loss(model, dict(batch))
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    for name, p in model.named_parameters():  # the tied head / embedding included
        torch.testing.assert_close(got[name], p.grad, rtol=1e-4, atol=1e-7, msg=name)
    with torch.no_grad():  # evaluation forwards keep their logits (metrics may read them): the plain loss
        torch.testing.assert_close(trainer.compute_loss(model.eval(), dict(batch)), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("model_class, config", [
    (Gemma2ForCausalLM, Gemma2Config(**SMALL, final_logit_softcapping=0.5)),  # tanh softcap
    (CohereForCausalLM, CohereConfig(**SMALL, logit_scale=3.0)),
    (GraniteForCausalLM, GraniteConfig(**SMALL, logits_scaling=0.25)),
], ids=["gemma2 softcap", "cohere logit_scale", "granite logits_scaling"])
def test_heads_with_scales_and_softcaps_pass_the_probe_and_give_the_models_own_loss(model_class, config):
    torch.manual_seed(0)
    model = model_class(config)
    head = chunked_loss_head(model)  # the probe runs here
    ids = torch.randint(0, config.vocab_size, (2, 9))
    labels = ids.masked_fill(torch.rand(ids.shape) < 0.3, -100)
    logits = model(input_ids=ids).logits
    expected = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
    outputs = model(**hidden_state_inputs({"input_ids": ids}))
    torch.testing.assert_close(ChunkedCausalLMLoss(head)(outputs, labels), expected, rtol=1e-5, atol=1e-6)


def test_a_forward_that_changes_the_logits_beyond_the_head_is_refused_by_the_probe():
    torch.manual_seed(0)
    model = DoubledLogitsLlama(LlamaConfig(**SMALL))
    chunked_loss_head(LlamaForCausalLM(LlamaConfig(**SMALL)))  # the same model without the doubling passes
    with pytest.raises(RecipeError, match="model.chunked_loss.*not its LM head applied to its last hidden state"):
        chunked_loss_head(model)


def test_a_model_without_an_output_head_is_refused():
    with pytest.raises(RecipeError, match="model.chunked_loss: LlamaModel's output head is not found"):
        chunked_loss_head(LlamaModel(LlamaConfig(**SMALL)))


def test_lora_on_the_head_is_refused_before_training(tiny_llama_dir, tmp_path):
    raw = chat_recipe(tiny_llama_dir, tmp_path / "run")
    raw["model"]["chunked_loss"] = True
    raw["lora"] = {"r": 4, "target_modules": ["q_proj", "lm_head"]}
    with pytest.raises(RecipeError, match="model.chunked_loss.*not a plain torch.nn.Linear"):
        build_run(load_recipe(raw))


@pytest.mark.parametrize("change, problem", [
    ({"method": "dpo", "data": {"format": "preference", "train": {"path": str(DATA / "preference_demo.jsonl")}}},
     "method sft"),
    ({"model": {"task": "sequence_classification", "num_labels": 2},
      "data": {"format": "classification", "train": {"path": str(DATA / "topics_train.jsonl")}}}, "causal LM"),
])
def test_recipes_where_the_chunked_loss_cannot_apply_are_refused_when_loaded(tiny_llama_dir, tmp_path, change,
                                                                             problem):
    raw = chat_recipe(tiny_llama_dir, tmp_path / "run")
    raw["model"]["chunked_loss"] = True
    raw["model"].update(change.get("model", {}))
    raw["data"] = change["data"]
    raw["method"] = change.get("method", "sft")
    with pytest.raises(RecipeError, match=f"model.chunked_loss.*{problem}"):
        load_recipe(raw)
