"""Mixtures of experts (hf_tune/model/moe.py): the shape read from the model, LoRA on attention and the fused expert
tensors (never the router), the router's load-balancing loss against a computation by hand, training, resume, reload
and merge by shard of tiny random Qwen3-MoE, Mixtral and gpt-oss models; and the published models' plans offline."""

from __future__ import annotations

import json
import math

import pytest
import torch
import yaml
from conftest import DATA, chat_recipe

from hf_tune import load_recipe, train
from hf_tune.errors import RecipeError

SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=512, head_dim=8)
FAMILIES = {  # transformers' config class, its keyword arguments; 4 experts, 2 a token
    "qwen3_moe": ("Qwen3MoeConfig", dict(intermediate_size=64, moe_intermediate_size=16, num_experts=4,
                                          num_experts_per_tok=2, router_aux_loss_coef=0.01)),
    "mixtral": ("MixtralConfig", dict(intermediate_size=16, num_local_experts=4, num_experts_per_tok=2,
                                      router_aux_loss_coef=0.02)),
    "gpt_oss": ("GptOssConfig", dict(intermediate_size=16, num_local_experts=4, num_experts_per_tok=2,
                                     layer_types=["sliding_attention", "full_attention"], sliding_window=64,
                                     router_aux_loss_coef=0.9)),
}


def tiny_moe(folder, tokenizer, family: str) -> str:
    import transformers

    class_name, kwargs = FAMILIES[family]
    config = getattr(transformers, class_name)(**SMALL, **kwargs, vocab_size=len(tokenizer),
                                               pad_token_id=tokenizer.pad_token_id,
                                               eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # the router starts at zero in some families: draw it, so tokens route apart
        for name, param in model.named_parameters():
            if name.endswith(("gate.weight", "router.weight")):
                param.normal_(0, 0.5)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory, smol_tokenizer) -> dict[str, str]:
    return {family: tiny_moe(tmp_path_factory.mktemp(family), smol_tokenizer, family) for family in FAMILIES}


def by_hand(config) -> tuple[int, int]:
    """(total, active) parameters of a tiny model from its config: embeddings and head, attention, norms, routers and
    experts, as the modeling files of the three families lay them out."""
    d, layers, vocab = config.hidden_size, config.num_hidden_layers, config.vocab_size
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    hd = getattr(config, "head_dim", None) or d // heads
    experts, k = getattr(config, "num_experts", None) or config.num_local_experts, config.num_experts_per_tok
    gpt_oss = config.model_type == "gpt_oss"
    inner = config.moe_intermediate_size if config.model_type == "qwen3_moe" else config.intermediate_size
    attention = d * hd * (heads + 2 * kv) + heads * hd * d
    if gpt_oss:
        attention += hd * (heads + 2 * kv) + d + heads  # q/k/v/o biases and the attention sinks
    norms = 2 * d + (2 * hd if config.model_type == "qwen3_moe" else 0)  # + q/k norms
    router = experts * d + (experts if gpt_oss else 0)
    per_expert = 3 * d * inner + ((2 * inner + d) if gpt_oss else 0)  # gate_up, down (+ their biases)
    outside = 2 * vocab * d + d + layers * (attention + norms + router)  # untied embeddings and head, final norm
    return outside + layers * experts * per_expert, outside + layers * k * per_expert


@pytest.mark.parametrize("family", FAMILIES)
def test_the_shape_counts_every_expert_held_and_the_active_ones_by_hand(family, moe_dirs):
    from transformers import AutoModelForCausalLM

    from hf_tune.model.moe import moe_shape

    model = AutoModelForCausalLM.from_pretrained(moe_dirs[family])
    shape = moe_shape(model)
    total, active = by_hand(model.config)
    assert (shape.experts, shape.experts_per_token, shape.moe_layers) == (4, 2, 2)
    assert shape.total_parameters == total == sum(p.numel() for p in model.parameters())
    assert shape.active_parameters == active
    assert shape.expert_weights == ("down_proj", "gate_up_proj")


@pytest.mark.parametrize("family", FAMILIES)
def test_all_linear_lora_adapts_attention_and_the_experts_never_the_router(family, moe_dirs, tmp_path):
    from hf_tune.model import build_model, build_tokenizer

    raw = chat_recipe(moe_dirs[family], tmp_path / "run")
    raw["lora"] = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": "all-linear"}
    recipe = load_recipe(raw)
    model = build_model(recipe, build_tokenizer(recipe))
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in name for name in trained)
    for layer in range(2):
        adapted = {name.split(f"layers.{layer}.", 1)[1].split(".lora_")[0] for name in trained
                   if f"layers.{layer}." in name}
        assert {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"} <= adapted
        assert any(name.startswith("mlp.experts") for name in adapted), adapted  # the fused expert tensors
        assert not any(".gate" in name or "router" in name for name in adapted), adapted
    config = model.peft_config["default"]
    assert set(config.target_parameters) == {"experts.gate_up_proj", "experts.down_proj"}


PUBLISHED = {  # the authors' figures, in billions: total, and active per token (their counting, see below)
    "Qwen/Qwen3-30B-A3B": (30.5, 3.3), "mistralai/Mixtral-8x7B-Instruct-v0.1": (46.7, 12.9),
    "openai/gpt-oss-20b": (20.9, 3.6)}


@pytest.mark.parametrize("name", PUBLISHED)
def test_plan_counts_the_published_models_by_hand(name, offline):
    """The shipped config.json of each family, sized on the meta device as plan does: the counts by hand, and the
    published totals. Active parameters here include the input embedding (a token reads its row); OpenAI's 3.6B for
    gpt-oss-20b leaves it out, so its row is compared without it."""
    from hf_tune.model.meta import build_meta_model
    from hf_tune.model.moe import moe_shape
    from hf_tune.recipe import validate_recipe

    recipe = validate_recipe({"model": {"pretrained_model_name_or_path": name},
                              "data": {"train": {"path": str(DATA / "chat_demo.jsonl")}}})
    model = build_meta_model(recipe)
    shape = moe_shape(model)
    total, active = by_hand(model.config)
    assert (shape.total_parameters, shape.active_parameters) == (total, active)
    published_total, published_active = PUBLISHED[name]
    embedding = model.config.vocab_size * model.config.hidden_size if "gpt-oss" in name else 0
    assert round(total / 1e9, 1) == published_total
    assert abs((active - embedding) / 1e9 - published_active) < 0.06  # published to one decimal (Qwen: 3.35 as 3.3)


@pytest.mark.slow
def test_init_adapts_the_experts_where_they_fit_and_attention_only_where_they_do_not(offline, tmp_path):
    """Qwen3-30B-A3B on one 73 GB GPU (a budget of 65.7 GB): LoRA on the 128 experts' fused tensors does not fit
    (their adapters and AdamW states: 67.4 GB planned), LoRA on attention does (63.8 GB), with its dropout; the recipe
    says why. At 75 GB (67.5) the experts' candidate sat 0.1 GB from the budget and flipped between hosts, whose
    measured activations differ by that much."""
    from hf_tune.workflows.init_recipe import write_recipe

    out = tmp_path / "r.yaml"
    choice = write_recipe("Qwen/Qwen3-30B-A3B", out, gpus=1, gpu_memory_gb=73,
                          data=str(DATA / "chat_demo.jsonl"))
    written = yaml.safe_load(out.read_text())
    assert choice.experts == "attention"
    assert written["lora"]["target_modules"] == ["k_proj", "o_proj", "q_proj", "v_proj"]
    assert written["lora"]["lora_dropout"] == 0.05 and "target_parameters" not in written["lora"]
    text = out.read_text()
    assert "LoRA on attention only, the experts and routers frozen: adapters on the experts too do not fit" in text
    assert "128 experts, 8 per token, in 48 layers; 30.53B parameters held, 3.35B active per token" in text


def test_experts_adapted_with_dropout_is_refused_with_both_ways_out(moe_dirs, tmp_path):
    from hf_tune.model import build_model, build_tokenizer

    raw = chat_recipe(moe_dirs["qwen3_moe"], tmp_path / "run")
    raw["lora"] = {"r": 4, "lora_dropout": 0.05, "target_modules": "all-linear"}
    recipe = load_recipe(raw)
    with pytest.raises(RecipeError) as err:
        build_model(recipe, build_tokenizer(recipe))
    assert err.value.key == "lora.lora_dropout" and "lora.lora_dropout: 0" in err.value.fix
    assert "lora.target_modules: [k_proj, o_proj, q_proj, v_proj]" in err.value.fix
    raw["lora"]["target_modules"] = ["q_proj", "k_proj", "v_proj", "o_proj"]  # attention only: dropout is fine
    model = build_model(load_recipe(raw), build_tokenizer(recipe))
    assert not any("experts" in name for name, p in model.named_parameters() if p.requires_grad)


def switch_loss(router_logits: tuple[torch.Tensor, ...], experts: int, k: int) -> float:
    """The Switch Transformer's load-balancing loss over every MoE layer's router logits, from its paper: E times the
    sum over experts of (the fraction of token-slots routed to it) x (its mean router probability), the fractions
    counted over the top-k choices of every token of every layer."""
    logits = torch.cat([layer.float() for layer in router_logits])
    probs = logits.softmax(-1)
    chosen = torch.zeros_like(probs).scatter_(1, probs.topk(k, dim=-1).indices, 1.0)
    return float(experts * (chosen.mean(0) * probs.mean(0)).sum())


def test_the_router_loss_is_on_logged_and_equals_the_switch_loss_by_hand(moe_dirs, tmp_path):
    """One step on one chat (its loss is logged from the forward before the update): the logged router loss is the
    Switch loss of the model's own router logits on that chat, and the logged loss is the cross-entropy plus the
    config's coefficient times it."""
    from transformers import AutoModelForCausalLM

    raw = chat_recipe(moe_dirs["qwen3_moe"], tmp_path / "run", max_steps=1, per_device_train_batch_size=1)
    raw["data"]["train"]["split"] = "train[:1]"
    raw["lora"] = {"r": 4, "lora_dropout": 0.0, "target_modules": "all-linear"}
    trainer = train(load_recipe(raw))
    logged = next(e for e in trainer.state.log_history if "loss" in e)
    example = trainer.train_dataset[0]
    ids, labels = torch.tensor([example["input_ids"]]), torch.tensor([example["labels"]])
    base = AutoModelForCausalLM.from_pretrained(moe_dirs["qwen3_moe"])  # LoRA's B starts at zero: the base's outputs
    with torch.no_grad():
        out = base(input_ids=ids, output_router_logits=True)
    aux = switch_loss(out.router_logits, 4, 2)
    trained = labels[0, 1:] != -100
    cross_entropy = float(torch.nn.functional.cross_entropy(out.logits[0, :-1][trained].float(),
                                                            labels[0, 1:][trained]))
    assert logged["router_aux_loss"] == pytest.approx(aux, rel=1e-5)
    assert logged["loss"] == pytest.approx(cross_entropy + 0.01 * aux, rel=1e-4)
    decided = json.loads((tmp_path / "run" / "run.json").read_text())["decisions"]
    assert decided["router_aux_loss_coef"] == 0.01


def test_a_router_loss_coefficient_on_a_dense_model_is_refused(tiny_llama_dir, tmp_path):
    from hf_tune.assembly.decisions import decide
    from hf_tune.training_args import build_training_arguments

    raw = chat_recipe(tiny_llama_dir, tmp_path / "run")
    raw["model"]["router_aux_loss_coef"] = 0.01
    recipe = load_recipe(raw)
    with pytest.raises(RecipeError, match="model.router_aux_loss_coef: .* does not route"):
        decide(recipe, build_training_arguments(recipe))


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits.float()


@pytest.mark.parametrize("family", FAMILIES)
def test_a_tiny_moe_learns_reloads_and_merges_by_shard(family, moe_dirs, tmp_path):
    """LoRA on attention and the fused experts: the loss falls; the saved adapter reloads to the trained model's
    logits; ``hf-tune merge`` writes the merged model shard by shard (Qwen3-MoE's and Mixtral's checkpoints hold one
    tensor per expert, gpt-oss's the fused ones) with the logits of base + adapter, which are not the base's."""
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM

    from hf_tune.records.run_reader import open_run
    from hf_tune.workflows.merge_run import merge
    from hf_tune.workflows.serve import vllm_command

    raw = chat_recipe(moe_dirs[family], tmp_path / "run", max_steps=12, learning_rate=5e-2,
                      per_device_train_batch_size=4, data_seed=1)
    raw["data"]["train"]["split"] = "train[:8]"  # two batches, seen six times each
    raw["lora"] = {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "target_modules": "all-linear"}
    trainer = train(load_recipe(raw))
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert len(losses) == 12 and all(math.isfinite(x) for x in losses)
    # the same two batches alternate (shuffled apart per epoch): each epoch's pair of losses against the first's
    assert sum(losses[-2:]) < sum(losses[:2]) - 0.2, losses
    assert all(e["router_aux_loss"] > 0 for e in trainer.state.log_history if "loss" in e)

    ids = torch.tensor([trainer.train_dataset[0]["input_ids"][:24]])
    trained = logits(trainer.model, ids)
    assert torch.allclose(logits(AutoPeftModelForCausalLM.from_pretrained(tmp_path / "run"), ids), trained,
                          atol=1e-5)
    result = merge(tmp_path / "run", out=tmp_path / "merged", check=True)
    assert result["streamed"]["merged_tensors"] == 2 * (4 + 2)  # per layer: 4 attention projections, 2 fused
    merged = logits(AutoModelForCausalLM.from_pretrained(tmp_path / "merged"), ids)
    assert torch.allclose(merged, trained, atol=1e-5)
    assert (merged - logits(AutoModelForCausalLM.from_pretrained(moe_dirs[family]), ids)).abs().max() > 1e-2
    # vLLM's LoRA loads no fused-expert delta: `serve` hands it the merge (RUN_DIR/merged), never the adapter
    command = vllm_command(open_run(tmp_path / "run"), "127.0.0.1", 8011)
    assert "--enable-lora" not in command and command[2] == str(tmp_path / "run" / "merged")
    assert torch.allclose(logits(AutoModelForCausalLM.from_pretrained(command[2]), ids), trained, atol=1e-5)


def test_a_moe_lora_run_resumed_from_its_checkpoint_ends_bit_identical(moe_dirs, tmp_path):
    """Six steps with a save every 3, and the same recipe resumed from that run's checkpoint-3 in another folder:
    the losses of steps 4 to 6 and every adapter tensor, fused experts' included, are equal."""
    import shutil

    from safetensors.torch import load_file

    def recipe(folder):
        raw = chat_recipe(moe_dirs["qwen3_moe"], folder, max_steps=6, save_strategy="steps", save_steps=3,
                          learning_rate=1e-2, seed=4)
        raw["lora"] = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": "all-linear"}
        return load_recipe(raw)

    train(recipe(tmp_path / "whole"))
    shutil.copytree(tmp_path / "whole" / "checkpoint-3", tmp_path / "resumed" / "checkpoint-3")
    train(recipe(tmp_path / "resumed"))

    def history(folder):
        state = json.loads((folder / "trainer_state.json").read_text())["log_history"]
        return [(e["step"], e["loss"], e["router_aux_loss"]) for e in state if "loss" in e]

    assert history(tmp_path / "resumed") == history(tmp_path / "whole")
    mine = load_file(tmp_path / "resumed" / "adapter_model.safetensors")
    theirs = load_file(tmp_path / "whole" / "adapter_model.safetensors")
    assert mine.keys() == theirs.keys() and any("experts" in k for k in mine)
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)
