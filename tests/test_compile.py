"""``training.torch_compile`` with hf_tune's packed, flattened ``sdpa_varlen`` batches: the pack length, the number of
examples and the longest example change every step, and the compiled model must not recompile every step."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import chat_recipe
from transformers import TrainerCallback

from hf_tune import build_run, load_recipe


class GraphsPerStep(TrainerCallback):
    """Dynamo's count of compiled graphs after each step, and each step's flattened length."""

    def __init__(self):
        self.graphs: list[int] = []

    def on_step_end(self, args, state, control, **kwargs):
        from torch._dynamo.utils import counters

        self.graphs.append(counters["stats"]["unique_graphs"])


@pytest.fixture
def one_layer_llama_dir(tmp_path, smol_tokenizer) -> str:
    """A random 1-layer Llama: inductor compiles each layer's kernels cold, and one layer shows every recompile."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(smol_tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         pad_token_id=smol_tokenizer.pad_token_id, eos_token_id=smol_tokenizer.eos_token_id,
                         tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")
    smol_tokenizer.save_pretrained(tmp_path / "llama")
    return str(tmp_path / "llama")


@pytest.mark.slow
def test_compiled_training_on_packs_stops_recompiling_after_the_first_steps(tmp_path, one_layer_llama_dir):
    torch._dynamo.reset()
    # 9 steps: the first 3 may compile, the 6 after them must each bring a new shape and no new graph
    raw = chat_recipe(one_layer_llama_dir, tmp_path / "run", max_steps=9, torch_compile=True, learning_rate=1e-3)
    raw["data"].update(batch_tokens=256, max_length=128)
    raw["lora"] = {"r": 4, "target_modules": "all-linear", "lora_dropout": 0.0}
    run = build_run(load_recipe(raw))
    assert run.model.config._attn_implementation == "sdpa_varlen"
    lengths = []
    collate = run.trainer.data_collator

    def recording(examples):
        batch = collate(examples)
        lengths.append((batch["input_ids"].shape[-1], len(batch["cu_seq_lens_q"]) - 1, int(batch["max_length_q"])))
        return batch

    run.trainer.data_collator = recording
    graphs = GraphsPerStep()
    run.trainer.add_callback(graphs)
    run.trainer.train()
    assert len(set(lengths[3:])) == len(lengths[3:]) > 5  # every later step has a new shape ...
    assert graphs.graphs[3:] == [graphs.graphs[2]] * (len(graphs.graphs) - 3)  # ... and compiles nothing new
    assert graphs.graphs[2] <= 3 * graphs.graphs[0]  # at most two recompilations: length, then example count
    losses = [e["loss"] for e in run.trainer.state.log_history if "loss" in e]
    assert len(losses) == 9 and all(math.isfinite(x) for x in losses)
