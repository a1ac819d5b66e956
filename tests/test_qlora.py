"""Quantized bases (hf_tune/model/quantization.py, hf_tune/recipe/quantization.py): the recipe keys and refusals,
QLoRA training on a tiny Llama, the merge that dequantizes, plan's weight memory; the QLoRA recipe on SmolLM2."""

from __future__ import annotations

import json
import os

import launch
import pytest
import torch
from conftest import REPO, chat_recipe

from hf_tune import load_recipe, train
from hf_tune.errors import HfTuneError

NF4 = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True,
       "bnb_4bit_compute_dtype": "float32"}
FP4 = {"load_in_4bit": True, "bnb_4bit_quant_type": "fp4", "bnb_4bit_compute_dtype": "float32"}
LORA = {"r": 4, "lora_alpha": 8, "target_modules": "all-linear", "lora_dropout": 0.0}


def qlora_recipe(model_dir, out, quantization=NF4, lora=LORA, **training) -> dict:
    raw = chat_recipe(model_dir, out, **training)
    raw["model"]["quantization_config"] = dict(quantization)
    if lora is not None:
        raw["lora"] = dict(lora)
    return raw


@pytest.mark.parametrize("change, key, words", [
    ({"bnb_4bit_quant_typ": "nf4"}, "model.quantization_config.bnb_4bit_quant_typ", "did you mean 'bnb_4bit_quant_type'"),
    ({"bnb_4bit_quant_type": "int4"}, "model.quantization_config.bnb_4bit_quant_type", "nf4, fp4"),
    ({"load_in_4bit": False}, "model.quantization_config", "quantizes nothing"),
    ({"load_in_8bit": True}, "model.quantization_config.load_in_4bit", "load_in_8bit are both true"),
    ({"bnb_4bit_compute_dtype": "float64"}, "model.quantization_config.bnb_4bit_compute_dtype", "float32"),
    ({"quant_method": "gptq"}, "model.quantization_config.quant_method", "bitsandbytes"),
])
def test_quantization_config_is_checked_key_by_key(tmp_path, tiny_llama_dir, change, key, words):
    raw = qlora_recipe(tiny_llama_dir, tmp_path, {**NF4, **change})
    with pytest.raises(HfTuneError) as info:
        load_recipe(raw)
    assert str(info.value).startswith(f"{key}:") and words in str(info.value)


def test_a_config_json_block_is_accepted_as_written(tmp_path, tiny_llama_dir):
    """BitsAndBytesConfig.to_dict() carries quant_method and private flags: a pasted block loads."""
    from transformers import BitsAndBytesConfig

    from hf_tune.model.quantization import bitsandbytes_config

    written = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4").to_dict()
    written = {k: v for k, v in written.items() if isinstance(v, (bool, str, int, float, type(None)))}
    recipe = load_recipe(qlora_recipe(tiny_llama_dir, tmp_path, written))
    config = bitsandbytes_config(recipe.model.quantization_config)
    assert config.load_in_4bit and config.bnb_4bit_quant_type == "nf4"


def test_full_fine_tune_of_a_4bit_base_is_refused_naming_both_keys(tmp_path, tiny_llama_dir):
    with pytest.raises(HfTuneError) as info:
        load_recipe(qlora_recipe(tiny_llama_dir, tmp_path, lora=None))
    message = str(info.value)
    assert message.startswith("model.quantization_config.load_in_4bit:") and "lora section" in message


SHARDED = {"deepspeed": "zero3"}, {"fsdp": "full_shard auto_wrap"}


@pytest.mark.parametrize("sharding", SHARDED, ids=["zero3", "fsdp"])
def test_a_sharded_4bit_base_needs_its_quant_storage_equal_to_the_model_dtype(tmp_path, tiny_llama_dir, sharding):
    """PEFT's ZeRO-3 / FSDP QLoRA: the packed 4-bit weights stored in the model's float dtype are sharded like any
    other parameter; the default uint8 storage, or another dtype than the model's, is refused naming the key."""
    for storage, dtype in ((None, "bfloat16"), ("bfloat16", "float32"), ("bfloat16", None), ("uint8", "bfloat16")):
        raw = qlora_recipe(tiny_llama_dir, tmp_path, {**NF4, "bnb_4bit_quant_storage": storage}, **sharding)
        raw["model"]["dtype"] = dtype
        with pytest.raises(HfTuneError) as info:
            load_recipe(raw)
        message = str(info.value)
        assert message.startswith("model.quantization_config.bnb_4bit_quant_storage:"), message
        assert f"training.{next(iter(sharding))}" in message and "to model.dtype" in message
    raw = qlora_recipe(tiny_llama_dir, tmp_path, {**NF4, "bnb_4bit_quant_storage": "bfloat16"}, **sharding)
    raw["model"]["dtype"] = "bfloat16"
    assert load_recipe(raw).model.quantization_config["bnb_4bit_quant_storage"] == "bfloat16"


def test_a_sharded_8bit_base_is_refused_naming_both_keys(tmp_path, tiny_llama_dir):
    with pytest.raises(HfTuneError) as info:
        load_recipe(qlora_recipe(tiny_llama_dir, tmp_path, {"load_in_8bit": True}, deepspeed="zero3"))
    message = str(info.value)
    assert message.startswith("training.deepspeed:") and "model.quantization_config.load_in_8bit" in message
    assert load_recipe(qlora_recipe(tiny_llama_dir, tmp_path, {"load_in_8bit": True}, deepspeed="zero2"))


@pytest.mark.slow
def test_two_process_zero3_qlora_partitions_the_4bit_weights_and_saves_a_reloadable_adapter(tmp_path, tiny_llama_dir):
    """ZeRO-3 QLoRA as PEFT documents it (bnb_4bit_quant_storage = model.dtype), on CPU with gloo: DeepSpeed shards
    each packed 4-bit weight over the 2 ranks, the loss stays finite, and the adapter reloads onto a 4-bit base."""

    import yaml
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from hf_tune.model.quantization import bitsandbytes_config, keep_weight_layout

    stored = {**NF4, "bnb_4bit_quant_storage": "float32"}  # the CPU's model dtype; bfloat16 on a GPU
    raw = qlora_recipe(tiny_llama_dir, tmp_path / "run", stored, max_steps=3, deepspeed="zero3", learning_rate=1e-2)
    raw["model"]["dtype"] = "float32"
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    result = launch.run(*launch.zero(2, str(REPO / "tests" / "qlora_zero3_probe.py"), str(recipe),
                                          str(tmp_path / "report")), env=launch.TORCH_EXTENSIONS, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"report.rank{rank}").read_text()) for rank in (0, 1)]
    for report in ranks:
        assert report["engine"] == "DeepSpeedEngine" and len(report["weights"]) == 2 * 7
        for name, weight in report["weights"].items():  # each rank holds half of every packed weight
            assert weight["dtype"] == "torch.float32" and weight["shard"] == -(-weight["full"] // 2), name
        assert len(report["losses"]) == 3 and all(math_finite(loss) for loss in report["losses"])
    assert ranks[0]["losses"] == ranks[1]["losses"]

    adapter = load_file(tmp_path / "run" / "adapter_model.safetensors")
    assert len(adapter) == 2 * 7 * 2 and all(t.numel() > 0 for t in adapter.values())
    assert all(t.abs().sum() > 0 for name, t in adapter.items() if "lora_B" in name)  # B starts at 0: it trained
    base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, quantization_config=bitsandbytes_config(stored),
                                                dtype=torch.float32)
    keep_weight_layout(base)
    ids = torch.tensor([[1, 504, 3458, 282, 4649, 314, 2]])
    before = logits_of(base, ids)
    reloaded = PeftModel.from_pretrained(base, tmp_path / "run").eval()
    after = logits_of(reloaded, ids)
    assert torch.isfinite(after).all() and not torch.allclose(after, before)


@pytest.mark.parametrize("token", ["hf_" + "a" * 34, True])
def test_a_token_in_the_model_section_is_refused(tmp_path, tiny_llama_dir, token):
    raw = chat_recipe(tiny_llama_dir, tmp_path)
    raw["model"]["token"] = token
    with pytest.raises(HfTuneError, match=r"^model\.token: .*\n  fix: .*HF_TOKEN"):
        load_recipe(raw)


def test_from_pretrained_location_keys_reach_the_loader(tmp_path, tiny_llama_dir):
    """cache_dir and subfolder are from_pretrained's: a model saved in a subfolder loads from it."""
    import shutil

    from hf_tune import build_model_and_tokenizer

    shutil.copytree(tiny_llama_dir, tmp_path / "repo" / "weights")
    raw = chat_recipe(str(tmp_path / "repo"), tmp_path / "out")
    raw["model"].update(subfolder="weights", cache_dir=str(tmp_path / "cache"), device_map="cpu")
    model, tokenizer = build_model_and_tokenizer(load_recipe(raw))
    assert model.config.num_hidden_layers == 2 and len(tokenizer) == model.config.vocab_size
    raw["model"]["subfolder"] = "nowhere"
    with pytest.raises(HfTuneError, match="^model.subfolder: .* has no folder 'nowhere'"):
        build_model_and_tokenizer(load_recipe(raw))


def lora_tensors(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def logits_of(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.fixture(scope="module")
def qlora_run(tmp_path_factory, tiny_llama_dir):
    """A 4-bit nf4 + double-quant QLoRA run of 3 steps with an evaluation in the middle."""
    out = tmp_path_factory.mktemp("qlora") / "run"
    raw = qlora_recipe(tiny_llama_dir, out, max_steps=3, eval_strategy="steps", eval_steps=2, learning_rate=5e-3,
                       per_device_eval_batch_size=4)
    raw["data"]["eval_split"] = 0.05
    recipe = load_recipe(raw)
    from hf_tune import build_run

    before = lora_tensors(build_run(recipe).model)
    trainer = train(recipe)
    return out, trainer, before


def test_qlora_trains_the_adapters_of_a_4bit_base_and_reloads_to_the_same_logits(qlora_run, tiny_llama_dir):
    import bitsandbytes as bnb
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from hf_tune.model.quantization import bitsandbytes_config, keep_weight_layout

    out, trainer, before = qlora_run
    model = trainer.model
    quantized = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(quantized) == 2 * 7  # q, k, v, o, gate, up, down in each of the 2 blocks
    assert all(m.weight.quant_state.quant_type == "nf4" and m.weight.quant_state.nested for m in quantized)
    # the evaluation at step 2 did not repack the weights into bitsandbytes' bf16 CPU layout
    assert not any(getattr(m.weight.quant_state, "packing_format_for_cpu", False) for m in quantized)
    after = lora_tensors(model)
    assert after.keys() == before.keys() and all("lora_" in name for name in after)
    assert all(not torch.equal(after[n], before[n]) for n in after if "lora_B" in n)  # B starts at 0 and moved
    history = trainer.state.log_history
    assert any("eval_loss" in e for e in history) and all(math_finite(e.get("loss", 0.0)) for e in history)

    base = AutoModelForCausalLM.from_pretrained(
        tiny_llama_dir, quantization_config=bitsandbytes_config(NF4), dtype=torch.float32)
    keep_weight_layout(base)  # else an inference forward on an AVX512-BF16 CPU computes in bfloat16
    reloaded = PeftModel.from_pretrained(base, out).eval()
    ids = torch.tensor([[1, 504, 3458, 282, 4649, 314, 2]])
    model.eval()
    assert torch.allclose(logits_of(reloaded, ids), logits_of(model, ids), atol=1e-5, rtol=0)


def math_finite(value: float) -> bool:
    return value == value and abs(value) != float("inf")


def test_merge_dequantizes_the_base_and_adds_the_adapter(qlora_run, tmp_path):
    """The merged q_proj weight equals the dequantized 4-bit weight plus scale * B @ A, computed here from the saved
    files; the merge's own logits check passes at the float32 tolerance."""
    import bitsandbytes as bnb
    from safetensors.torch import load_file

    from hf_tune.workflows.merge_run import MERGE_CHECK_TOLERANCE, merge

    out, trainer, _ = qlora_run
    result = merge(out, tmp_path / "merged", dtype="float32", check=True)
    assert result["relative_diff"] <= MERGE_CHECK_TOLERANCE["float32"] == result["tolerance"]
    assert result["dequantized_from"]["bnb_4bit_quant_type"] == "nf4"
    config = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert "quantization_config" not in config

    layer = trainer.model.base_model.model.model.layers[1].self_attn.q_proj
    base_weight = bnb.functional.dequantize_4bit(layer.base_layer.weight.data, layer.base_layer.weight.quant_state)
    adapter = load_file(out / "adapter_model.safetensors")
    a = adapter["base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"]
    b = adapter["base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"]
    expected = base_weight.float() + (LORA["lora_alpha"] / LORA["r"]) * b @ a
    merged = load_file(tmp_path / "merged" / "model.safetensors")["model.layers.1.self_attn.q_proj.weight"]
    assert merged.dtype == torch.float32
    assert torch.allclose(merged, expected, atol=1e-6, rtol=0)


def test_merge_into_quantized_weights_is_refused_naming_both(qlora_run, tmp_path):
    out, _, _ = qlora_run
    with pytest.raises(HfTuneError, match=r"--dtype nf4 with the run's model.quantization_config"):
        from hf_tune.workflows.merge_run import merge

        merge(out, tmp_path / "merged", dtype="nf4")


def test_an_8bit_qlora_run_trains_and_merges(tmp_path, tiny_llama_dir):
    import bitsandbytes as bnb

    from hf_tune.workflows.merge_run import MERGE_CHECK_TOLERANCE, merge

    trainer = train(load_recipe(qlora_recipe(tiny_llama_dir, tmp_path / "run", {"load_in_8bit": True},
                                             learning_rate=5e-3)))
    assert sum(isinstance(m, bnb.nn.Linear8bitLt) for m in trainer.model.modules()) == 2 * 7
    assert all(p.abs().sum() > 0 for n, p in trainer.model.named_parameters() if "lora_B" in n)
    result = merge(tmp_path / "run", tmp_path / "merged", dtype="float32", check=True)
    assert result["tolerance"] == MERGE_CHECK_TOLERANCE["bfloat16"] and result["relative_diff"] <= result["tolerance"]


def test_plan_shows_the_quantized_weight_memory(tmp_path, tiny_llama_dir):
    """Weight bytes against the tensors a quantized checkpoint saves (packed weights and every quantization
    statistic), and the parameter count against the unquantized model's."""
    from transformers import AutoModelForCausalLM

    from hf_tune.commands.plan import format_plan
    from hf_tune.model.quantization import bitsandbytes_config
    from hf_tune.workflows.plan import plan

    raw = qlora_recipe(tiny_llama_dir, tmp_path / "run", FP4)
    result = plan(load_recipe(raw), out_dir=tmp_path / "plan")
    weights = result["quantized_weights"]
    full = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, quantization_config=bitsandbytes_config(FP4))
    stored, seen = 0, set()
    for key, tensor in base.state_dict().items():  # the tied LM head once; not the quant state's JSON blob
        if "quant_state.bitsandbytes" not in key and tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            stored += tensor.numel() * tensor.element_size()
    adapters = sum(p.numel() * 4 for n, p in plan_model_params(raw).items() if "lora_" in n)
    assert weights["bytes"] == stored + adapters
    assert weights["params"] == sum(p.numel() for p in full.parameters()) + adapters // 4
    assert "4-bit fp4" in format_plan(result) and "unquantized" in format_plan(result)


def plan_model_params(raw) -> dict[str, torch.Tensor]:
    from hf_tune import build_model_and_tokenizer

    model, _ = build_model_and_tokenizer(load_recipe(raw))
    return dict(model.named_parameters())


def test_model_flops_of_a_4bit_base_count_the_unpacked_weights(tiny_llama_dir):
    """A 4-bit layer's weight tensor holds packed bytes; FLOPs follow the layer's shape, as in float32."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from hf_tune.model.quantization import bitsandbytes_config
    from hf_tune.trainer.throughput import model_flops

    config = LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM")
    full = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_llama_dir), config)
    quantized = get_peft_model(AutoModelForCausalLM.from_pretrained(
        tiny_llama_dir, quantization_config=bitsandbytes_config(NF4)), config)
    assert model_flops(quantized, True) == model_flops(full, True)


@pytest.mark.slow
def test_the_qlora_recipe_trains_smollm2_offline(tmp_path):
    out, chats = tmp_path / "run", tmp_path / "chats.jsonl"
    chats.write_text("".join((REPO / "examples" / "data" / "chat_demo.jsonl").read_text().splitlines(True)[:24]))
    result = launch.run("python", "-m", "hf_tune.run", str(REPO / "recipes" / "llm_qlora.yaml"), "training.max_steps=1",
                     "training.eval_strategy=no", "training.save_strategy=no", f"training.output_dir={out}",
                     f"data.train.path={chats}", "data.eval_split=0.125", "data.batch_tokens=256",
                     "data.max_length=256", "training.per_device_eval_batch_size=3")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "QLoRA: 4-bit nf4, double quantization, compute float32 base prepared" in result.stderr
    adapter = json.loads((out / "adapter_config.json").read_text())
    assert adapter["r"] == 16 and os.path.getsize(out / "adapter_model.safetensors") > 1_000_000
    metrics = json.loads((out / "all_results.json").read_text())
    assert metrics["train_tokens"] > 0 and metrics["eval_loss"] < 5
