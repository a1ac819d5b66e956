"""The NaN guard (hf_tune/trainer/loss_guard.py): a non-finite loss is kept on the device and stops the run at the next log
or save, naming its step, and no checkpoint holds it."""

from __future__ import annotations

import pytest
import torch
from conftest import chat_recipe
from transformers import TrainerCallback


class PlantNaN(TrainerCallback):
    """After optimizer step ``after``, a NaN in the final norm: every loss from step ``after + 1`` on is NaN. Records
    the steps that started."""

    def __init__(self, after: int):
        self.after, self.steps = after, []

    def on_step_begin(self, args, state, control, **kwargs):
        self.steps.append(state.global_step + 1)  # the steps that started

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step == self.after:
            base = model.get_base_model() if hasattr(model, "get_base_model") else model
            with torch.no_grad():
                base.model.norm.weight[0] = float("nan")


def train_with_nan(tmp_path, tiny_llama_dir, after: int, **training):
    from hf_tune import build_run, load_recipe
    from hf_tune.errors import HfTuneError

    raw = chat_recipe(tiny_llama_dir, tmp_path / "run", max_steps=8, **training)
    trainer = build_run(load_recipe(raw)).trainer
    planted = PlantNaN(after)
    trainer.add_callback(planted)
    with pytest.raises(HfTuneError) as info:
        trainer.train()
    saved = sorted(int(p.name.split("-")[1]) for p in (tmp_path / "run").glob("checkpoint-*"))
    return str(info.value), planted.steps, saved


def test_a_nan_is_reported_at_the_next_log_with_the_step_it_happened(tmp_path, tiny_llama_dir):
    error, steps, _ = train_with_nan(tmp_path, tiny_llama_dir, after=1, logging_steps=4)
    assert "the loss at step 2 is nan (not finite)" in error
    assert steps == [1, 2, 3, 4]  # no host sync at steps 2 and 3: the flag was read at step 4's log


def test_no_checkpoint_is_saved_from_the_nan_step_on(tmp_path, tiny_llama_dir):
    error, steps, saved = train_with_nan(tmp_path, tiny_llama_dir, after=2, logging_steps=100,
                                         save_strategy="steps", save_steps=2)
    assert "the loss at step 3 is nan" in error and "last good checkpoint: " in error
    assert error.split("last good checkpoint: ")[1].split()[0].endswith("checkpoint-2")
    assert saved == [2] and steps == [1, 2, 3, 4]  # step 4's save found the NaN of step 3 before writing


def test_a_nan_in_the_last_steps_is_found_before_the_final_model_is_saved(tmp_path, tiny_llama_dir):
    error, steps, _ = train_with_nan(tmp_path, tiny_llama_dir, after=6, logging_steps=100)
    assert "the loss at step 7 is nan" in error and steps[-1] == 8


def test_the_guard_keeps_the_first_bad_step_and_its_loss():
    from hf_tune.trainer.loss_guard import NonFiniteLossGuard

    guard = NonFiniteLossGuard()
    for step, loss in enumerate([1.5, 2.0, float("inf"), float("nan"), 0.5], start=1):
        guard.add(torch.tensor(loss), step)
    assert int(guard.first_bad_step) == 3 and float(guard.first_bad_loss) == float("inf")
