"""One decision per run (hf_tune/assembly/decisions.py): what ``plan`` shows is what the run runs, a check on the real
model may only fall back (recorded), and the run fits the memory it has (hf_tune/assembly/memory_fit.py)."""

from __future__ import annotations

import json
from pathlib import Path

import launch
import pytest
import torch
import yaml
from conftest import REPO, chat_recipe

from hf_tune import load_recipe
from hf_tune.assembly.decisions import decide, decide_attention
from hf_tune.assembly.run_build import build_run
from hf_tune.training_args import build_training_arguments
from hf_tune.workflows.plan import plan
from hf_tune.workflows.train import train

# the shipped recipes that train a causal LM, each trained one step on the tiny Llama in place of SmolLM2
SHIPPED = ["llm_lora", "llm_lora_eval", "llm_dpo", "llm_orpo", "llm_simpo", "llm_grpo", "llm_rloo",
           "llm_distillation", "reward_model"]


def shipped_on_tiny(name: str, model: str, out: Path) -> dict:
    raw = yaml.safe_load((REPO / "recipes" / f"{name}.yaml").read_text())
    raw["model"]["pretrained_model_name_or_path"] = model
    if raw.get("teacher"):
        raw["teacher"]["pretrained_model_name_or_path"] = model
    for source in ("train", "eval"):  # the shipped data, found from anywhere
        if isinstance(raw["data"].get(source), dict) and not Path(raw["data"][source]["path"]).is_absolute():
            raw["data"][source]["path"] = str(REPO / raw["data"][source]["path"])
    raw.pop("evaluation", None)  # downstream tasks at each evaluation: not what this test is about
    raw["data"].pop("eval_split", None)
    for key in ("metric_for_best_model", "load_best_model_at_end", "greater_is_better"):
        raw["training"].pop(key, None)
    raw["training"].update(output_dir=str(out), max_steps=1, save_strategy="no", eval_strategy="no",
                           report_to="none", logging_steps=1)
    return raw


def without_fallbacks(decisions: dict) -> dict:
    """The decisions as taken before the model loaded: each recorded fallback's decided value back in place."""
    taken = {**decisions, "fallbacks": []}
    for record in decisions["fallbacks"]:
        taken[record["decision"]] = record["decided"]
    return taken


@pytest.mark.parametrize("name", SHIPPED)
def test_each_shipped_recipe_runs_the_decisions_its_plan_shows(name, tiny_llama_dir, tmp_path):
    raw = shipped_on_tiny(name, tiny_llama_dir, tmp_path / "run")
    planned = plan(load_recipe(raw), out_dir=tmp_path / "plan")["decisions"]
    train(load_recipe(raw))
    ran = json.loads((tmp_path / "run" / "run.json").read_text())["decisions"]
    assert without_fallbacks(ran) == planned
    for record in ran["fallbacks"]:  # a fallback names what was decided, what ran and why
        assert record["why"] and record["decided"] != record["ran"]


def test_flash_attention_is_decided_only_for_a_model_that_supports_it(tiny_llama_dir, tmp_path, monkeypatch):
    """On a Hopper card in bf16 with flash-attn installed (the hardware and package are what this machine lacks:
    stood in for), a model class without ``_supports_flash_attn`` runs sdpa_varlen, as the build would load it."""
    import transformers.utils as utils
    from transformers import AutoConfig, LlamaForCausalLM

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(utils, "is_flash_attn_2_available", lambda: True)
    monkeypatch.setattr(utils, "is_flash_attn_3_available", lambda: False)
    recipe = load_recipe(chat_recipe(tiny_llama_dir, tmp_path / "run"))
    # the arguments of that GPU run, in bf16 (TrainingArguments would refuse bf16 and a GPU on this machine)
    args = type("Args", (), {"bf16": True, "fp16": False, "deepspeed": None, "use_cpu": False})()
    config = AutoConfig.from_pretrained(tiny_llama_dir)
    assert decide_attention(recipe, args, LlamaForCausalLM, config) == "flash_attention_2"

    class NoFlashLlama(LlamaForCausalLM):
        _supports_flash_attn = False

    assert decide_attention(recipe, args, NoFlashLlama, config) == "sdpa_varlen"


def test_flash_attention_that_fails_to_load_falls_back_recorded(tiny_llama_dir, tmp_path, monkeypatch, caplog):
    """The decision says flash attention; flash-attn is not installed here, so loading it fails: the run falls back
    to sdpa_varlen (which also runs flattened examples apart), says so in one line, and run.json records it."""
    import hf_tune.assembly.run_build as run_build

    real = run_build.decide

    def decided_flash(*args, **kwargs):
        import dataclasses

        return dataclasses.replace(real(*args, **kwargs), attention="flash_attention_2")

    monkeypatch.setattr(run_build, "decide", decided_flash)
    with caplog.at_level("INFO", logger="hf_tune"):
        run = build_run(load_recipe(chat_recipe(tiny_llama_dir, tmp_path / "run")))
    base = run.model.get_base_model() if hasattr(run.model, "get_base_model") else run.model
    assert base.config._attn_implementation == "sdpa_varlen"
    [record] = run.decisions.fallbacks
    assert record["decision"] == "attention" and record["decided"] == "flash_attention_2"
    assert record["ran"] == "sdpa_varlen" and "flash attention failed to load" in record["why"]
    assert "attention: flash_attention_2 decided, sdpa_varlen runs instead" in caplog.text


def test_a_qlora_plan_computes_in_float32_where_the_compute_dtype_is_left_unset(tiny_llama_dir, tmp_path):
    """``BitsAndBytesConfig`` computes in float32 when ``bnb_4bit_compute_dtype`` is unset: the plan measures its
    activations so (it assumed bfloat16), and the built 4-bit layers compute in it."""
    from transformers import BitsAndBytesConfig

    def planned(**quantization):
        raw = chat_recipe(tiny_llama_dir, tmp_path / "run")
        raw["model"]["quantization_config"] = {"load_in_4bit": True, **quantization}
        raw["lora"] = {"r": 4, "target_modules": "all-linear"}
        return plan(load_recipe(raw), out_dir=tmp_path / "plan")

    unset, fp32, bf16 = planned(), planned(bnb_4bit_compute_dtype="float32"), planned(bnb_4bit_compute_dtype="bfloat16")
    upstream = str(BitsAndBytesConfig(load_in_4bit=True).bnb_4bit_compute_dtype).removeprefix("torch.")
    assert unset["decisions"]["compute_dtype"] == upstream == "float32"
    assert unset["activations"]["bytes"] == fp32["activations"]["bytes"] != bf16["activations"]["bytes"]


def test_arguments_are_built_once_and_the_launch_checked_once_per_run(tiny_llama_dir, tmp_path, monkeypatch):
    import transformers

    import hf_tune.assembly.run_build as run_build
    import hf_tune.runtime.distributed as distributed
    import hf_tune.workflows.train as workflow

    recipe = load_recipe(chat_recipe(tiny_llama_dir, tmp_path / "run", max_steps=1))  # preflight builds its own
    built, checked = [], []
    post_init = transformers.TrainingArguments.__post_init__
    monkeypatch.setattr(transformers.TrainingArguments, "__post_init__",
                        lambda self: built.append(1) or post_init(self))
    check = distributed.check_distributed
    for module in (run_build, workflow):
        monkeypatch.setattr(module, "check_distributed", lambda args: checked.append(1) or check(args))
    train(recipe)
    assert len(built) == 1 and len(checked) == 1


# The memory fit, measured: each run in its own process (its peak RSS is the run's), on data whose every example
# fills max_length, with a budget (machine.gpu_memory_gb) below the recipe's unfitted plan.
LONG = " ".join(["the quick brown fox jumps over the lazy dog"] * 110)  # about 1,000 tokens


def long_data(path: Path, kind: str) -> Path:
    rows = []
    for i in range(8):  # one optimizer step of upstream's batch of 8
        prompt = [{"role": "user", "content": f"Tell me story {i}."}]
        if kind == "chat":
            rows.append({"messages": [*prompt, {"role": "assistant", "content": LONG}]})
        elif kind == "preference":
            rows.append({"prompt": prompt, "chosen": [{"role": "assistant", "content": LONG}],
                         "rejected": [{"role": "assistant", "content": LONG[::-1]}]})
        else:
            rows.append({"prompt": [{"role": "user", "content": LONG[:2000]}], "answer": "1"})  # < 512 tokens
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def fit_recipe(method: str, model: str, tmp_path: Path, budget_gb: float) -> dict:
    """A recipe silent on checkpointing and on the micro-batch (upstream's 8 examples), with a full fine-tune's
    float32 logits over a 49k vocabulary: about 0.8 MB a position, so the unfitted micro-batch needs several GB."""
    kind = {"sft": "chat", "dpo": "preference", "grpo": "prompts"}[method]
    raw = {"model": {"pretrained_model_name_or_path": model},
           "data": {"train": {"path": str(long_data(tmp_path / f"{kind}.jsonl", kind))}},
           "training": {"output_dir": str(tmp_path / method), "max_steps": 1, "learning_rate": 1e-4,
                        "report_to": "none", "save_strategy": "no", "logging_steps": 1, "bf16": False,
                        "disable_tqdm": True},
           "machine": {"gpu_memory_gb": budget_gb}}
    if method == "sft":
        raw["data"].update(format="chat", max_length=1024)
    elif method == "dpo":
        raw.update(method="dpo")
        raw["data"]["format"] = "preference"
        raw["training"]["max_length"] = 1024  # checkpointing: on, TRL's default for DPO
        # TRL's padded pairs, whose fused head's tiles the fit has to shrink: flattened (the default), the same pairs
        # fit 6.5 GB as written (3.2 GB planned; tests/test_flat_pairs.py)
        raw["training"]["padding_free"] = False
    else:
        raw.update(method="grpo", rewards=[{"name": "exact_answer", "column": "answer"}])
        raw["data"]["format"] = "prompt_only"
        raw["training"].update(num_generations=4, max_completion_length=8, beta=0.0)
    return raw


@pytest.mark.slow
@pytest.mark.parametrize("method, budget_gb", [("sft", 5.0), ("dpo", 6.5), ("grpo", 5.0)])
def test_a_run_over_its_budget_is_fitted_trains_and_stays_within_it(method, budget_gb, tiny_llama_dir, tmp_path):
    raw = fit_recipe(method, tiny_llama_dir, tmp_path, budget_gb)
    unfitted = decide(load_recipe(raw), build_training_arguments(load_recipe(raw)), fit=False)
    path = tmp_path / f"{method}.yaml"
    path.write_text(yaml.safe_dump(raw))
    launch.run("python", "-m", "hf_tune.run", str(path))
    manifest = json.loads((tmp_path / method / "run.json").read_text())
    memory = manifest["decisions"]["memory"]
    assert memory["changed"] and memory["fits"]  # something was changed, and the plan now fits
    decided = manifest["decisions"]
    # the effective batch is unchanged: micro-batch x accumulation as upstream's defaults made it
    assert (decided["per_device_train_batch_size"] * decided["gradient_accumulation_steps"]
            == unfitted.per_device_train_batch_size * unfitted.gradient_accumulation_steps)
    assert decided["checkpointing"] or decided["per_device_train_batch_size"] < unfitted.per_device_train_batch_size
    # measured: the process's peak resident memory (Linux's own count) within the usable budget
    assert manifest["metrics"]["train_peak_memory_gb"] * 2**30 <= memory["budget_bytes"]


def test_a_recipe_key_that_cannot_fit_is_refused_before_the_weights_load(tiny_llama_dir, tmp_path, capsys):
    from hf_tune.errors import RecipeError

    raw = fit_recipe("sft", tiny_llama_dir, tmp_path, 3.2)
    raw["training"]["per_device_train_batch_size"] = 8
    with pytest.raises(RecipeError) as refused:
        build_run(load_recipe(raw))
    assert refused.value.key == "training.per_device_train_batch_size"
    assert "over the budget of 2.88 GB (90% of 3.20 GB, machine.gpu_memory_gb)" in str(refused.value)
    assert not (tmp_path / "sft").exists()
