"""The run's random numbers are the training's alone (hf_tune/trainer/generators.py): no monitor, probe, evaluation or
measurement draws from the generators the run seeded, so an evaluated run trains exactly as one that is not, and a
new user's first run (an empty cache) is reproduced bit for bit."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import launch
import numpy as np
import pytest
import torch
from conftest import DATA, REPO, chat_recipe
from safetensors.torch import load_file

from hf_tune import load_recipe
from hf_tune.assembly.run_build import build_run
from hf_tune.workflows.train import train


def generator_states() -> tuple:
    """Every global generator a training step or a library may draw from, as comparable values."""
    return (torch.get_rng_state().clone(), random.getstate(), str(np.random.get_state()))


def same_states(before: tuple, after: tuple) -> bool:
    return torch.equal(before[0], after[0]) and before[1] == after[1] and before[2] == after[2]


def lora_chat_recipe(model: str, out: Path, **training) -> dict:
    raw = chat_recipe(model, out, max_steps=6, learning_rate=2e-2, seed=11, **training)
    raw["lora"] = {"r": 4, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.1}  # dropout draws every step
    return raw


def test_an_evaluated_run_trains_exactly_as_the_same_run_without_evaluation(tiny_llama_dir, tmp_path):
    plain = lora_chat_recipe(tiny_llama_dir, tmp_path / "plain")
    evaluated = lora_chat_recipe(tiny_llama_dir, tmp_path / "evaluated", eval_strategy="steps", eval_steps=2)
    for raw in (plain, evaluated):  # the same training data: an eval file beside it, not a split of it
        raw["data"]["eval"] = {"path": str(DATA / "chat_demo.jsonl"), "split": "train[:8]"}
        train(load_recipe(raw))
    history = {name: json.loads((tmp_path / name / "trainer_state.json").read_text())["log_history"]
               for name in ("plain", "evaluated")}
    assert sum("eval_loss" in row for row in history["evaluated"]) >= 3  # it did evaluate, every 2 steps
    losses = {name: [row["loss"] for row in rows if "loss" in row] for name, rows in history.items()}
    assert len(losses["plain"]) == 6 and losses["plain"] == losses["evaluated"]
    mine, theirs = (load_file(tmp_path / name / "adapter_model.safetensors") for name in ("plain", "evaluated"))
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_no_monitor_probe_or_measurement_draws_from_the_run_s_generators(tiny_llama_dir, tmp_path, monkeypatch):
    from hf_tune.assembly.memory_fit import estimate_peak
    from hf_tune.model import activation_probe, packing_probe
    from hf_tune.model.chunked_head import chunked_loss_head
    from hf_tune.model.meta import build_meta_model
    from hf_tune.trainer.peak_flops import measured_peak_flops

    monkeypatch.setenv("HF_TUNE_CACHE", str(tmp_path / "empty-cache"))  # the peak is measured, not read
    raw = lora_chat_recipe(tiny_llama_dir, tmp_path / "run", eval_strategy="steps", eval_steps=2)
    raw["data"]["eval_split"] = 0.1
    raw["evaluation"] = {"samples": ["What is 2 + 2?"]}  # generated greedily at each evaluation
    recipe = load_recipe(raw)
    run = build_run(recipe)
    trainer, args = run.trainer, run.args
    checks = {
        "the measured peak FLOP/s": lambda: measured_peak_flops(torch.device("cpu"), torch.float32),
        "the activation probe": lambda: (activation_probe._FITS.clear(), estimate_peak(
            recipe, args, run.decisions, build_meta_model(recipe), 1)),
        "the packing probe": lambda: (packing_probe._VERDICTS.clear(), packing_probe.probe_padding_free(
            type(run.model.get_base_model()), "sdpa_varlen", True, run.model.config)),
        "the chunked loss's proof on the model": lambda: chunked_loss_head(run.model),
        "an evaluation (its data loader, samples and callbacks)": lambda: trainer.evaluate(),
    }
    handler, state, control = trainer.callback_handler, trainer.state, trainer.control
    trainer.create_optimizer_and_scheduler(num_training_steps=6)
    handler.optimizer, handler.lr_scheduler = trainer.optimizer, trainer.lr_scheduler
    for event in ("on_init_end", "on_train_begin", "on_epoch_begin", "on_step_begin", "on_substep_end",
                  "on_pre_optimizer_step", "on_optimizer_step", "on_step_end", "on_log", "on_save", "on_epoch_end",
                  "on_train_end"):
        kwargs = {"logs": {"loss": 1.0}} if event == "on_log" else {}
        checks[f"every callback's {event}"] = (lambda event=event, kwargs=kwargs:
                                                getattr(handler, event)(args, state, control, **kwargs))
    state.global_step = 2
    for name, check in checks.items():
        torch.manual_seed(1234)
        before = generator_states()
        check()
        assert same_states(before, generator_states()), f"{name} drew from the run's generators"


@pytest.mark.slow
def test_the_demo_on_an_empty_cache_is_reproduced_bit_for_bit(tmp_path, smol_dir):
    """As `make demo` runs it (accelerate launch, the shipped recipe, shortened to 3 steps, evaluated after each), on
    a cache that holds only the converted model (no measured peak FLOP/s), then `hf-tune reproduce`."""
    cache = tmp_path / "cache"
    (cache / "models").mkdir(parents=True)
    (cache / "models" / Path(smol_dir).name).symlink_to(smol_dir)
    env = {"HF_TUNE_CACHE": str(cache)}
    run = tmp_path / "llm_lora"
    first = launch.run("accelerate", "launch", "--num_processes", "1", "--num_machines", "1", "--mixed_precision", "no",
               "--dynamo_backend", "no", "-m", "hf_tune.run", str(REPO / "recipes" / "llm_lora.yaml"),
               f"training.output_dir={run}", "training.max_steps=3", "training.eval_steps=1",
               "training.save_steps=3", "training.logging_steps=1", env=env, cwd=REPO)
    assert first.returncode == 0, first.stderr[-3000:]
    assert (cache / "peak_flops.json").is_file()  # measured during that first run
    report = launch.run("hf-tune", "reproduce", str(run), env=env, cwd=REPO).stdout
    assert report.rstrip().endswith("reproduced: yes"), report
    assert "weights: identical" in report and "identical at all 3 logged steps" in report
    shutil.rmtree(tmp_path / "llm_lora-reproduced", ignore_errors=True)
