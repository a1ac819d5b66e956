"""data.streaming: an IterableDataset tokenized and packed on the fly; max_steps checked when the recipe loads; a
resumed streamed run ends with the weights of an uninterrupted one (hf_tune/data/streaming.py)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import DATA, chat_recipe

from hf_tune.errors import HfTuneError


def streamed(tiny_llama_dir, output_dir, **data) -> dict:
    recipe = chat_recipe(tiny_llama_dir, output_dir, max_steps=4)
    recipe["data"].update(streaming=True, **data)
    return recipe


@pytest.mark.parametrize("change, key", [({"training": {"max_steps": -1}}, "training.max_steps"),
                                         ({"data": {"eval_split": 0.1}}, "data.eval_split")])
def test_a_stream_needs_max_steps_and_cannot_hold_out_a_fraction(tmp_path, tiny_llama_dir, change, key):
    from hf_tune import load_recipe

    recipe = streamed(tiny_llama_dir, tmp_path / "run")
    for section, values in change.items():
        recipe[section].update(values)
    with pytest.raises(HfTuneError, match=rf"^{key}: "):
        load_recipe(recipe)


def test_the_stream_gives_the_tokens_of_the_map_style_data_in_order(tmp_path, tiny_llama_dir, smol_tokenizer):
    from hf_tune import load_recipe
    from hf_tune.data import build_datasets

    recipe = streamed(tiny_llama_dir, tmp_path / "run")
    stream, _ = build_datasets(load_recipe(recipe), smol_tokenizer)
    recipe["data"]["streaming"] = False
    whole, _ = build_datasets(load_recipe(recipe), smol_tokenizer)
    rows = list(stream)
    assert [r["input_ids"] for r in rows] == whole["input_ids"] and [r["labels"] for r in rows] == whole["labels"]


def test_streamed_packs_hold_every_example_once_within_the_budget(tmp_path, tiny_llama_dir, smol_tokenizer):
    from hf_tune import load_recipe
    from hf_tune.data import build_datasets

    recipe = streamed(tiny_llama_dir, tmp_path / "run", batch_tokens=512)
    packs, _ = build_datasets(load_recipe(recipe), smol_tokenizer)
    recipe["data"].update(streaming=False, batch_tokens=None)
    whole, _ = build_datasets(load_recipe(recipe), smol_tokenizer)
    examples = [tuple(ids) for pack in packs for ids in pack["input_ids"]]
    assert sorted(examples) == sorted(tuple(ids) for ids in whole["input_ids"])
    assert max(sum(len(ids) for ids in pack["input_ids"]) for pack in packs) <= 512


def final_weights(run_dir) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(run_dir / "model.safetensors")


def test_a_resumed_streamed_run_ends_bit_exact(tmp_path, tiny_llama_dir):
    """Run A trains 4 steps on the stream, saving at step 2. Run B starts from A's checkpoint-2 and resumes: Trainer
    replays the stream and skips the 2 batches already trained, so B's weights equal A's bit for bit. Run C resumes
    the same checkpoint but is told not to skip (ignore_data_skip): it trains on the first batches again, and ends
    elsewhere (the comparison can fail)."""
    from hf_tune import load_recipe, train

    def recipe_for(name, **training):
        recipe = streamed(tiny_llama_dir, tmp_path / name, batch_tokens=256)
        recipe["training"].update(save_strategy="steps", save_steps=2, per_device_train_batch_size=1, **training)
        recipe["model"]["dtype"] = "float32"
        return load_recipe(recipe)

    train(recipe_for("a"))
    for name in ("b", "c"):
        (tmp_path / name).mkdir()
        shutil.copytree(tmp_path / "a" / "checkpoint-2", tmp_path / name / "checkpoint-2")
    resumed = train(recipe_for("b"))
    checkpoint_logs = json.loads((tmp_path / "a" / "checkpoint-2" / "trainer_state.json").read_text())["log_history"]
    assert resumed.state.log_history[:len(checkpoint_logs)] == checkpoint_logs  # resumed, not started afresh
    assert [log["step"] for log in resumed.state.log_history if "loss" in log] == [1, 2, 3, 4]
    train(recipe_for("c", ignore_data_skip=True))
    a, b, c = (final_weights(tmp_path / name) for name in "abc")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)
