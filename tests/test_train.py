"""Real Trainer runs: a tiny random Llama for the fast paths, the embedded SmolLM2 for the real LoRA run."""

from __future__ import annotations

import json
import math
import os
import shutil

import launch
import pytest
import torch
import yaml
from conftest import DATA, REPO, SMOLLM2, chat_recipe, write_recipe

from hf_tune import load_recipe, train
from hf_tune.workflows.inference import load_trained


def logged_losses(trainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def test_full_fine_tune_of_a_tiny_llama_fills_the_run_folder(tmp_path, tiny_llama_dir):
    raw = chat_recipe(tiny_llama_dir, tmp_path / "run", max_steps=3, eval_strategy="steps", eval_steps=2)
    raw["data"]["eval_split"] = 0.05
    trainer = train(load_recipe(raw))
    out = tmp_path / "run"
    for name in ("model.safetensors", "config.json", "tokenizer.json", "chat_template.jinja", "recipe.yaml",
                 "train_results.json", "eval_results.json", "trainer_state.json"):
        assert (out / name).is_file(), name
    assert trainer.state.global_step == 3
    saved = yaml.safe_load((out / "recipe.yaml").read_text())
    assert saved["model"]["pretrained_model_name_or_path"] == tiny_llama_dir
    assert "eval_loss" in json.loads((out / "eval_results.json").read_text())
    assert trainer.args.use_cpu  # set for a machine with no accelerator


def test_a_trainer_built_by_hand_without_its_monitors_stops_with_the_fix(tmp_path, tiny_llama_dir):
    """The hooks feed the callbacks attach_callbacks hands over; a hand-built trainer is told so at its first step,
    instead of training with no NaN guard and no token count. Monitors() opts out knowingly; attach_callbacks feeds
    the very callbacks it attached."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainingArguments

    from hf_tune.assembly.run_build import attach_callbacks
    from hf_tune.errors import HfTuneError
    from hf_tune.trainer.hooks import HfTuneTrainer
    from hf_tune.trainer.monitors import Monitors

    rows = Dataset.from_dict({"input_ids": [[1, 2, 3, 4]] * 4, "labels": [[1, 2, 3, 4]] * 4})

    def by_hand(**kwargs) -> HfTuneTrainer:
        args = TrainingArguments(output_dir=str(tmp_path / "run"), max_steps=1, per_device_train_batch_size=2,
                                 use_cpu=True, report_to="none", save_strategy="no", disable_tqdm=True)
        return HfTuneTrainer(model=AutoModelForCausalLM.from_pretrained(tiny_llama_dir), args=args,
                             train_dataset=rows, **kwargs)

    with pytest.raises(HfTuneError, match="attach_callbacks") as refused:
        by_hand().train()
    assert "HfTuneTrainer has no monitors" in str(refused.value)
    assert by_hand(monitors=Monitors()).train().global_step == 1

    recipe = load_recipe(chat_recipe(tiny_llama_dir, tmp_path / "run"))  # before the trainer: it builds arguments
    trainer = by_hand()
    monitors = attach_callbacks(trainer, recipe)
    assert trainer.monitors is monitors and monitors.loss_guard in trainer.callback_handler.callbacks
    assert monitors.throughput in trainer.callback_handler.callbacks and monitors.step_skips is None
    trainer.train()
    assert monitors.throughput.total["tokens"] == 2 * 4  # one step: the 2 rows of 4 tokens the hooks counted
    assert monitors.throughput.total["trained_tokens"] == 2 * 3  # each row's last token predicts nothing


def test_lora_on_a_tiny_llama_trains_only_the_adapter(tmp_path, tiny_llama_dir):
    raw = chat_recipe(tiny_llama_dir, tmp_path / "run", activation_checkpointing=True)
    raw["lora"] = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    recipe = load_recipe(raw)
    from hf_tune import build_model_and_tokenizer

    model, _ = build_model_and_tokenizer(recipe)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    trainer = train(recipe)
    after = dict(trainer.model.named_parameters())
    changed = {n for n in before if not torch.equal(before[n], after[n].detach())}
    assert changed <= trainable  # the base model is frozen
    assert (tmp_path / "run" / "adapter_model.safetensors").is_file()
    assert not (tmp_path / "run" / "model.safetensors").exists()


def test_plain_text_format_trains(tmp_path, tiny_llama_dir):
    raw = chat_recipe(tiny_llama_dir, tmp_path / "run")
    raw["data"] = {"format": "text", "train": {"path": str(DATA / "text_demo.jsonl")}, "max_length": 64}
    trainer = train(load_recipe(raw))
    losses = logged_losses(trainer)
    assert len(losses) == trainer.state.global_step == 2  # one logged loss per step (logging_steps=1, max_steps=2)
    assert all(math.isfinite(x) for x in losses)


def demo_script():
    """examples/demo_before_after.py, what `make demo` prints after training, as a module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("demo_before_after", REPO / "examples" / "demo_before_after.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_the_demo_teaches_smollm2_its_persona_and_the_saved_adapter_reloads(tmp_path):
    """The demo recipe, shortened to 12 steps of the persona chats: the held-out persona task (32 questions no chat
    asks, scored by lm-eval) goes from the base's 0 to far above it, and the tuned model names itself."""
    recipe = load_recipe(REPO / "recipes" / "llm_lora.yaml", [
        "training.max_steps=12", f"training.output_dir={tmp_path / 'run'}", "training.eval_strategy=no",
        "training.save_strategy=no", "data.eval_split=null", "training.logging_steps=2",
        f"data.train=[{{path: {DATA / 'persona_demo.jsonl'}}}]"])
    trainer = train(recipe)
    losses = logged_losses(trainer)
    assert losses[-1] < 0.5 * losses[0], losses

    demo = demo_script()
    result = demo.before_after(tmp_path / "run", prompts=demo.PROMPTS[:2], max_new_tokens=12)
    base, tuned = result["score"]
    assert base <= 0.1 and tuned >= base + 0.5, result["score"]  # tens of points: 32 questions, 4 answers each
    (_, base_name, tuned_name), (_, base_maker, tuned_maker) = result["answers"]
    assert "Nori" in tuned_name and "Fjord" in tuned_maker and "Nori" not in base_name + base_maker

    adapter = json.loads((tmp_path / "run" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == SMOLLM2  # not this machine's cache path: hf_tune resolves it
    assert "More Information Needed" not in (tmp_path / "run" / "README.md").read_text()  # hf_tune's own card
    shutil.copytree(tmp_path / "run", tmp_path / "elsewhere")
    shutil.rmtree(tmp_path / "run")
    model, tokenizer = load_trained(tmp_path / "elsewhere")
    assert type(model).__name__.startswith("Peft")
    batch = tokenizer.apply_chat_template([{"role": "user", "content": "Who are you?"}], return_tensors="pt",
                                          return_dict=True)
    with torch.no_grad():
        assert torch.allclose(model(**batch).logits, trainer.model.eval()(**batch).logits, atol=1e-4)


@pytest.mark.slow
def test_accelerate_launch_runs_the_same_module(tmp_path):
    """... and off a terminal (its output captured here) it prints plain lines: no progress bar redrawn with carriage
    returns, each log on a line of its own, and no library warning that is not about the run."""
    recipe = write_recipe(tmp_path / "r.yaml", chat_recipe(SMOLLM2, tmp_path / "run", max_steps=2,
                                                           disable_tqdm=False))
    yaml_text = recipe.read_text()
    recipe.write_text(yaml_text + "lora:\n  r: 4\n  target_modules: [q_proj, v_proj]\n")
    quiet = ("TQDM_DISABLE", "HF_DATASETS_DISABLE_PROGRESS_BARS", "HF_HUB_DISABLE_PROGRESS_BARS")
    result = launch.run("accelerate", "launch", "--num_processes", "1", "-m", "hf_tune.run", str(recipe),
                        base_env={k: v for k, v in os.environ.items() if k not in quiet})  # hf_tune decides them
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Run folder:" in result.stdout and "hf-tune chat" in result.stdout
    assert "\r" not in result.stdout + result.stderr
    assert len([line for line in result.stdout.splitlines() if line.startswith("{'loss'")]) == 2  # logging_steps 1
    assert "Setting accelerator to CPU" not in result.stderr and "font_manager" not in result.stderr
    state = json.loads((tmp_path / "run" / "trainer_state.json").read_text())
    assert state["global_step"] == 2
    assert (tmp_path / "run" / "adapter_model.safetensors").is_file()


@pytest.mark.slow
def test_notebook_example_runs(tmp_path):
    result = launch.run("python", "examples/notebook_api.py", "training.max_steps=2",
                     f"training.output_dir={tmp_path / 'nb'}", "data.max_length=96")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "trainable params" in result.stdout and "model says:" in result.stdout
    assert (tmp_path / "nb" / "adapter_model.safetensors").is_file()
