"""Optimizer groups and schedule, checked against the definitions computed here, independently of hf_tune.optim.

  depth: embeddings 0, block i -> i + 1, everything after the last block L + 1;  lr = base * d ** (L + 1 - depth)
  schedule factor(s) = s / W for s < W, else r + (1 - r) * (1 + cos(pi * (s - W) / (T - W))) / 2
"""

from __future__ import annotations

import json
import math

import launch
import pytest
import torch
from conftest import DATA, chat_recipe
from inputs import BASE_LR, WD, expected
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    TrainerCallback,
    TrainingArguments,
)

from hf_tune import load_recipe
from hf_tune.errors import HfTuneError
from hf_tune.recipe.schema import OptimSection
from hf_tune.trainer.hooks import HfTuneTrainer


def tiny_llama():
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                                        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False))


def tiny_bert():
    return BertForSequenceClassification(BertConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                                    num_hidden_layers=3, num_attention_heads=2, num_labels=3))


def tiny_gpt2():
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=16, n_layer=3, n_head=2, n_positions=32))


def optimizer_view(model, groups: OptimSection, tmp_path, **args):
    trainer = HfTuneTrainer(model=model, args=TrainingArguments(output_dir=str(tmp_path), learning_rate=BASE_LR,
                                                                weight_decay=WD, use_cpu=True, report_to="none", **args),
                            optim=groups)
    optimizer = trainer.create_optimizer()
    seen = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            assert id(p) not in seen, "a parameter is in two groups"
            seen[id(p)] = (group["lr"], group["weight_decay"])
    return trainer, seen


@pytest.mark.parametrize("family, build", [("llama", tiny_llama), ("bert", tiny_bert), ("gpt2", tiny_gpt2)])
@pytest.mark.parametrize("decay, head_lr", [(0.7, None), (1.0, None), (0.5, 5e-2)])
def test_every_parameter_gets_the_lr_and_weight_decay_of_its_depth(tmp_path, family, build, decay, head_lr):
    model = build()
    _, seen = optimizer_view(model, OptimSection(layerwise_lr_decay=decay, head_lr=head_lr), tmp_path)
    trainable = {id(p): n for n, p in model.named_parameters() if p.requires_grad}
    assert seen.keys() == trainable.keys()  # no parameter lost, none duplicated
    for pid, name in trainable.items():
        lr, wd = expected(name, family, 3, decay, head_lr)
        assert seen[pid][0] == pytest.approx(lr, rel=1e-12), name
        assert seen[pid][1] == wd, name


def test_lora_adapters_get_the_depth_of_their_block(tmp_path):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_llama(), LoraConfig(r=2, target_modules=["q_proj", "v_proj", "down_proj"]))
    _, seen = optimizer_view(model, OptimSection(layerwise_lr_decay=0.6), tmp_path)
    trainable = {id(p): n for n, p in model.named_parameters() if p.requires_grad}
    assert seen.keys() == trainable.keys() and len(trainable) == 3 * 3 * 2
    for pid, name in trainable.items():
        assert "lora_" in name
        assert seen[pid] == pytest.approx(expected(name, "llama", 3, 0.6), rel=1e-12), name


def test_custom_no_decay_patterns_and_optimizer_class_from_training_args(tmp_path):
    model = tiny_llama()
    trainer, seen = optimizer_view(model, OptimSection(no_decay=[r"\.bias$", r"lm_head"]), tmp_path, optim="sgd")
    assert isinstance(trainer.optimizer, torch.optim.SGD)
    for name, p in model.named_parameters():
        assert seen[id(p)][1] == (0.0 if name.startswith("lm_head") else WD), name


def test_groups_are_rebuilt_for_each_trainer_without_losing_parameters(tmp_path):
    model = tiny_llama()
    first = optimizer_view(model, OptimSection(layerwise_lr_decay=0.8), tmp_path)[1]
    second = optimizer_view(model, OptimSection(layerwise_lr_decay=0.8), tmp_path)[1]
    assert first == second


def test_llrd_without_blocks_is_a_clear_error(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    with pytest.raises(HfTuneError, match="optim.layerwise_lr_decay"):
        HfTuneTrainer(model=model, args=TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none"),
                      optim=OptimSection(layerwise_lr_decay=0.9)).create_optimizer()


def factor(step: int, warmup: int, total: int, floor: float) -> float:
    if step < warmup:
        return step / warmup
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))


class RecordLr(TrainerCallback):
    """The LR of every group as applied by each optimizer step (after the step, before the scheduler moves on)."""

    def __init__(self):
        self.steps = []

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        self.steps.append((state.global_step, [g["lr"] for g in optimizer.param_groups]))


def run_tiny_llrd(tiny_llama_dir, out, recorder, max_steps, accumulation=1, resume=None, save_steps=None):
    from hf_tune.assembly.run_build import build_model_and_tokenizer, build_trainer
    from hf_tune.data import build_datasets
    from hf_tune.training_args import build_training_arguments

    raw = chat_recipe(tiny_llama_dir, out, max_steps=max_steps, learning_rate=BASE_LR, warmup_steps=4,
                      gradient_accumulation_steps=accumulation, weight_decay=WD, seed=0,
                      save_strategy="steps" if save_steps else "no", **({"save_steps": save_steps} if save_steps else {}))
    raw["optim"] = {"layerwise_lr_decay": 0.5, "min_lr_ratio": 0.1}
    recipe = load_recipe(raw)
    args = build_training_arguments(recipe)
    model, tokenizer = build_model_and_tokenizer(recipe)
    train_ds, _ = build_datasets(recipe, tokenizer)
    trainer = build_trainer(recipe, model, tokenizer, train_ds, None, args)
    trainer.add_callback(recorder)
    trainer.train(resume_from_checkpoint=resume)
    return trainer, model


def check_schedule(trainer, model, recorder, total, warmup, first_step=0):
    peaks = {}
    for group in trainer.optimizer.param_groups:
        names = {id(p): n for n, p in model.named_parameters()}
        lrs = {expected(names[id(p)], "llama", 2, 0.5)[0] for p in group["params"]}
        assert len(lrs) == 1
        peaks[id(group)] = lrs.pop()
    steps = [s for s, _ in recorder.steps]
    assert steps == list(range(first_step, total))  # one record per optimizer step, never per micro-batch
    for step, rates in recorder.steps:
        for group, rate in zip(trainer.optimizer.param_groups, rates):
            assert rate == pytest.approx(peaks[id(group)] * factor(step, warmup, total, 0.1), rel=1e-9, abs=1e-15), step


def test_warmup_cosine_with_floor_per_group_follows_the_closed_form(tmp_path, tiny_llama_dir):
    recorder = RecordLr()
    trainer, model = run_tiny_llrd(tiny_llama_dir, tmp_path / "a", recorder, max_steps=12)
    # embeddings (tied LM head, no decay) | 2 blocks x (decay, no decay) | final norm (no decay)
    assert len(trainer.optimizer.param_groups) == 1 + 2 * 2 + 1
    check_schedule(trainer, model, recorder, total=12, warmup=4)  # covers 0, W-1, W, mid-way and T-1
    logs = [e for e in trainer.state.log_history if "lr_min" in e]
    rates = [r for _, r in recorder.steps]
    for entry in logs:
        applied = rates[entry["step"] - 1]
        assert entry["lr_min"] == pytest.approx(min(applied), rel=1e-9)
        assert entry["lr_max"] == pytest.approx(max(applied), rel=1e-9)


def test_schedule_counts_optimizer_steps_under_gradient_accumulation(tmp_path, tiny_llama_dir):
    recorder = RecordLr()
    trainer, model = run_tiny_llrd(tiny_llama_dir, tmp_path / "b", recorder, max_steps=8, accumulation=3)
    assert trainer.args.gradient_accumulation_steps == 3 and trainer.state.global_step == 8
    assert len(recorder.steps) == 8  # one LR per optimizer step, not one per micro-batch (24)
    check_schedule(trainer, model, recorder, total=8, warmup=4)


def test_schedule_continues_exactly_after_resume(tmp_path, tiny_llama_dir):
    run_tiny_llrd(tiny_llama_dir, tmp_path / "c", RecordLr(), max_steps=10, save_steps=6)
    recorder = RecordLr()
    trainer, model = run_tiny_llrd(tiny_llama_dir, tmp_path / "c", recorder, max_steps=10,
                                   resume=str(tmp_path / "c" / "checkpoint-6"))
    assert [step for step, _ in recorder.steps] == [6, 7, 8, 9]  # resumed at step 6, not trained from 0
    check_schedule(trainer, model, recorder, total=10, warmup=4, first_step=6)


def test_deepspeed_optimizer_block_with_optim_section_is_refused_at_load(tmp_path, tiny_llama_dir):
    with_optimizer = tmp_path / "ds_optimizer.json"
    with_optimizer.write_text(json.dumps({"zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW"},
                                          "train_micro_batch_size_per_gpu": "auto"}))
    raw = chat_recipe(tiny_llama_dir, tmp_path / "run", deepspeed=str(with_optimizer))
    raw["optim"] = {"layerwise_lr_decay": 0.8}
    with pytest.raises(HfTuneError, match="training.deepspeed: .*'optimizer' block") as info:
        load_recipe(raw)
    assert "remove the 'optimizer' block" in str(info.value)


def test_min_lr_ratio_needs_a_cosine_schedule(tmp_path, tiny_llama_dir):
    raw = chat_recipe(tiny_llama_dir, tmp_path / "run", lr_scheduler_type="linear")
    raw["optim"] = {"min_lr_ratio": 0.1}
    with pytest.raises(HfTuneError, match="optim.min_lr_ratio"):
        load_recipe(raw)
    del raw["optim"]
    assert load_recipe(raw).training["lr_scheduler_type"] == "linear"  # other schedules keep working


def test_plan_counts_the_steps_the_run_takes_and_writes_the_schedule_plot(tmp_path, tiny_llama_dir):
    from hf_tune import train
    from hf_tune.workflows.plan import plan

    raw = chat_recipe(tiny_llama_dir, tmp_path / "run", max_steps=-1, num_train_epochs=2,
                      per_device_train_batch_size=8, gradient_accumulation_steps=3, warmup_steps=0.25)
    rows = (DATA / "chat_demo.jsonl").read_text().splitlines()[:50]
    (tmp_path / "small.jsonl").write_text("\n".join(rows) + "\n")
    raw["data"]["train"]["path"] = str(tmp_path / "small.jsonl")
    raw["optim"] = {"layerwise_lr_decay": 0.9}
    recipe = load_recipe(raw)
    result = plan(recipe, out_dir=tmp_path / "plan")
    batches = math.ceil(50 / 8)  # 7 batches of 8 per epoch -> 3 optimizer steps (3 + 3 + 1 micro-batches)
    assert result["steps_per_epoch"] == math.ceil(batches / 3) == 3
    assert result["total_steps"] == 6 and result["warmup_steps"] == math.ceil(6 * 0.25)
    assert result["effective_batch_size"] == 24
    assert (tmp_path / "plan" / "lr_schedule.png").stat().st_size > 10_000
    assert {row["depth"] for row in result["groups"]} == {0, 1, 2, 3}
    assert plan(recipe, world_size=4, out_dir=tmp_path / "plan4")["steps_per_epoch"] == 1  # ceil(ceil(7/4)/3)
    trainer = train(recipe)
    assert trainer.state.global_step == result["total_steps"]


@pytest.mark.slow
def test_deepspeed_zero2_steps_the_llrd_groups(tmp_path, tiny_llama_dir):
    """Single-process DeepSpeed on CPU (the multi-process runs belong to the DeepSpeed launcher tests)."""
    import collections

    from conftest import REPO
    from transformers import AutoModelForCausalLM

    config = tmp_path / "zero2.json"  # no optimizer / scheduler block: Trainer builds both, DeepSpeed steps them
    config.write_text(json.dumps({"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto",
                                  "train_batch_size": "auto", "gradient_accumulation_steps": "auto",
                                  "gradient_clipping": "auto"}))
    raw = chat_recipe(tiny_llama_dir, tmp_path / "run", max_steps=2, learning_rate=BASE_LR, weight_decay=WD,
                      deepspeed=str(config))
    raw["optim"] = {"layerwise_lr_decay": 0.5}
    recipe_path = tmp_path / "recipe.yaml"
    recipe_path.write_text(json.dumps(raw))  # JSON is YAML
    report_path = tmp_path / "report.json"
    result = launch.run(*launch.zero(1, str(REPO / "tests" / "deepspeed_probe.py"), str(recipe_path),
                                          str(report_path)), env=launch.TORCH_EXTENSIONS)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(report_path.read_text())
    assert report["deepspeed"] and report["engine"] == "DeepSpeedEngine" and "Zero" in report["wrapper"]

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    want = collections.Counter()
    for name, p in model.named_parameters():
        want[expected(name, "llama", 2, 0.5)] += p.numel()
    got = {(g["initial_lr"], g["weight_decay"]): g["numel"] for g in report["groups"]}
    assert len(got) == len(want) == 6
    for key, numel in want.items():  # ZeRO flattens each group, padding it to its alignment
        match = [n for (lr, wd), n in got.items() if lr == pytest.approx(key[0]) and wd == key[1]]
        assert len(match) == 1 and numel <= match[0] < numel + 64, (key, numel, match)
