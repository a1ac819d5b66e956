"""Plans of real-size models without their weights: the meta model, its parameter counts against the formula of the
architecture, the shipped recipes for 7B-72B models within their stated memory, and the activation estimate
against the tensors autograd really keeps."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import REPO

SCALE = sorted((REPO / "recipes" / "scale").glob("*.yaml"))


def decoder_params(c: dict) -> int:
    """Parameters of a Llama-style decoder by its config: embeddings (twice unless tied), per block the attention
    projections, the gated MLP and two norms, the final norm."""
    h, f, layers, vocab = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    head_dim = c.get("head_dim") or h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * head_dim, c["num_key_value_heads"] * head_dim
    bias = q + 2 * kv if c["model_type"] == "qwen2" else 0  # Qwen2 has biases on q, k, v
    qk_norms = 2 * head_dim if c["model_type"] in ("qwen3", "gemma3_text") else 0
    block = h * (q + 2 * kv) + q * h + bias + 3 * h * f + 2 * h + qk_norms
    block += 2 * h if c["model_type"] == "gemma3_text" else 0  # Gemma 3: pre- and post-feedforward norms too
    embeddings = vocab * h * (1 if c.get("tie_word_embeddings", c["model_type"] == "gemma3_text") else 2)
    return embeddings + layers * block + h


@pytest.mark.parametrize("name", ["meta-llama/Llama-3.1-70B-Instruct", "meta-llama/Llama-3.1-8B-Instruct",
                                  "Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-72B-Instruct", "Qwen/Qwen3-8B",
                                  "mistralai/Mistral-7B-Instruct-v0.3", "google/gemma-3-1b-it"])
def test_a_shipped_config_builds_the_published_model_on_the_meta_device(name, offline):
    import json

    from hf_tune.model.meta import build_meta_model, shipped_config_path
    from hf_tune.recipe import validate_recipe

    config = json.loads(shipped_config_path(name).read_text())
    recipe = validate_recipe({"model": {"pretrained_model_name_or_path": name},
                              "data": {"train": {"path": str(REPO / "examples/data/chat_demo.jsonl")}}})
    model = build_meta_model(recipe)
    params = list(model.parameters())
    assert {p.device.type for p in params} == {"meta"} and params[0].dtype == torch.bfloat16  # config: bfloat16
    assert sum(p.numel() for p in params) == decoder_params(config)
    published = {"meta-llama/Llama-3.1-70B-Instruct": 70_553_706_496, "meta-llama/Llama-3.1-8B-Instruct": 8_030_261_248}
    if name in published:  # the safetensors metadata of the Hub repositories
        assert decoder_params(config) == published[name]


@pytest.mark.slow
@pytest.mark.parametrize("path", SCALE, ids=[p.stem for p in SCALE])
def test_every_scale_recipe_validates_and_plans_offline_within_its_memory(path, offline, tmp_path, capsys):
    """Planned for the machine the recipe records (no --world-size), the estimate is the one its header states and
    fits that machine's GPU with init's headroom; validate reads the shipped config offline too."""
    from hf_tune import load_recipe
    from hf_tune.commands.cli import main
    from hf_tune.commands.plan import format_plan
    from hf_tune.workflows.plan import plan

    gpus, gpu_gb = map(int, re.search(r"(\d+)x(\d+)gb", path.stem).groups())
    result = plan(load_recipe(path), out_dir=tmp_path)
    assert result["world_size"] == gpus and result["machine"] == {"world_size": gpus, "gpu_memory_gb": gpu_gb}
    assert result["examples"] is None and "tokenizer" in result["data_not_read"]  # no tokenizer offline
    stated = float(re.search(r"estimated peak per rank: ([\d.]+) GB", path.read_text()).group(1))
    assert result["peak_per_rank"] / 2**30 == pytest.approx(stated, abs=0.05) and stated <= 0.9 * gpu_gb
    assert result["activations"]["source"] == "probe"
    text = format_plan(result)
    assert result["setup"] in text and f"fits the memory budget of {0.9 * gpu_gb:.2f} GB (90% of {gpu_gb:.2f} GB, " \
        "machine.gpu_memory_gb)" in text
    assert result["decisions"]["memory"]["changed"] == []  # init's choice fits as written: nothing refitted
    main(["validate", str(path)])
    attention = "eager" if "gpt-oss" in path.stem else "sdpa_varlen"  # gpt-oss's attention sinks: no SDPA kernel
    assert f"attn_implementation: {attention}  # hf_tune's default" in capsys.readouterr().out
    assert result["decisions"]["attention"] == attention


@pytest.mark.parametrize("path", sorted((REPO / "recipes").glob("*.yaml")), ids=lambda p: p.name)
def test_every_other_shipped_recipe_validates_and_plans_offline(path, offline, tmp_path, monkeypatch, capsys):
    from hf_tune.commands.cli import main

    monkeypatch.chdir(REPO)
    monkeypatch.syspath_prepend(str(REPO / "examples" / "agent"))  # llm_agent's environment module
    main(["validate", str(path)])
    main(["plan", str(path), "--out", str(tmp_path)])
    said = capsys.readouterr().out
    assert "estimated peak per rank" in said and ("probe: measured" in said or "formula" in said
                                                   or "not estimated for image models" in said)


def test_the_70b_qlora_plan_counts_4_bit_weights_partitioned_over_eight_ranks(offline, tmp_path):
    """By hand: NF4 with double quantization stores half a byte a weight plus, per 64 weights, a uint8 absmax and
    per 256 blocks a float32 one; embeddings, LM head and norms stay bf16; LoRA r=16 adapters are float32."""
    import json

    from hf_tune import load_recipe
    from hf_tune.workflows.plan import plan

    c = json.loads((REPO / "hf_tune/model/configs/meta-llama--Llama-3.1-70B-Instruct.json").read_text())
    h, f, layers, vocab = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    kv = c["num_key_value_heads"] * h // c["num_attention_heads"]
    shapes = [(h, h), (kv, h), (kv, h), (h, h), (f, h), (f, h), (h, f)]  # q k v o gate up down: (out, in)
    quantized = 0
    for out, inp in shapes:
        n = out * inp
        blocks = -(-n // 64)
        quantized += n // 2 + blocks + 4 * -(-blocks // 256) + 4 * 256 + 4 * 16
    adapters = sum(16 * (out + inp) for out, inp in shapes)
    weights = layers * (quantized + 2 * 2 * h + 4 * adapters) + 2 * (2 * vocab * h + h)
    result = plan(load_recipe(REPO / "recipes/scale/llama-3.1-70b-qlora-8x80gb.yaml"), world_size=8, out_dir=tmp_path)
    assert result["quantized_weights"]["bytes"] == weights
    assert result["trainable_params"] == layers * adapters
    states = layers * adapters * 18  # mixed precision AdamW per adapter parameter
    assert result["memory_per_rank"]["ZeRO-3"][0] == pytest.approx(4 * vocab * h + (weights + states) / 8)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_activation_estimate_covers_what_autograd_keeps(checkpointing):
    """Every non-parameter tensor autograd saves in a bf16 forward of a small Llama, counted once, against the
    estimate: no more than it (checkpointing keeps one layer's inputs only) and no less than 60 % of it without
    checkpointing (the estimate adds the float32 softmax and gradient of the logits, made during backward)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_tune.model.memory import activation_memory

    config = LlamaConfig(vocab_size=2000, hidden_size=128, intermediate_size=352, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16).train()
    if checkpointing:
        model.gradient_checkpointing_enable({"use_reentrant": False})
    params = {p.data_ptr() for p in model.parameters()}
    saved: dict[tuple, int] = {}

    def keep(tensor):
        if tensor.data_ptr() not in params:
            saved[(tensor.data_ptr(), tensor.dtype, tuple(tensor.shape))] = tensor.numel() * tensor.element_size()
        return tensor

    tokens = 512
    ids = torch.randint(0, config.vocab_size, (1, tokens))
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        model(input_ids=ids, labels=ids)
    measured, estimate = sum(saved.values()), activation_memory(config, tokens, checkpointing)
    assert measured <= estimate
    if not checkpointing:
        assert measured >= 0.6 * estimate


def test_under_the_chunked_loss_the_plan_counts_no_full_logits(offline, tmp_path):
    """The chunked loss (on by default under LoRA, whose LM head is frozen) never holds the logits. With
    ``model.chunked_loss: false`` the probe keeps one more float32 ``[positions, vocabulary]`` tensor for backward
    (the log-softmax of every position but the last: 4 bytes each), and at the peak at least two (that log-softmax
    and its gradient)."""
    from hf_tune import load_recipe
    from hf_tune.workflows.plan import plan

    path = REPO / "recipes/scale/gemma-3-1b-1x24gb.yaml"
    same = "training.activation_checkpointing=false"  # both as written: the full logits would not fit, refitted
    chunked = plan(load_recipe(path, [same]), out_dir=tmp_path)
    full = plan(load_recipe(path, [same, "model.chunked_loss=false"]), out_dir=tmp_path)
    tokens, vocabulary = chunked["activations"]["tokens"], 262_144
    assert tokens == load_recipe(path).data.batch_tokens
    assert chunked["decisions"]["chunked_loss"] and not full["decisions"]["chunked_loss"]
    kept = full["activations"]["bytes"] - chunked["activations"]["bytes"]
    assert kept == pytest.approx(4 * (tokens - 1) * vocabulary, rel=0.02)
    assert full["activations"]["peak_bytes"] - chunked["activations"]["peak_bytes"] >= 8 * tokens * vocabulary
    assert load_recipe(path).lora  # the shipped recipe is LoRA: the default applies


def test_a_plan_writes_only_into_its_out_folder(offline, tmp_path, monkeypatch):
    """``hf-tune plan --out DIR`` leaves no empty run folder behind (``training.output_dir`` is relative here)."""
    from hf_tune import load_recipe
    from hf_tune.workflows.plan import plan

    recipe = load_recipe(REPO / "recipes/scale/llama-3.1-8b-1x24gb.yaml",
                         [f"data.train.path={REPO / 'examples/data/chat_demo.jsonl'}"])
    monkeypatch.chdir(tmp_path)
    plan(recipe, out_dir=tmp_path / "plan")
    assert recipe.training["output_dir"].startswith("runs/") and not (tmp_path / "runs").exists()
