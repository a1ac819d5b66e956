"""data.streaming: an IterableDataset tokenized and packed on the fly; max_steps checked when the recipe loads; a
resumed streamed run ends with the weights of an uninterrupted one (hf_tune/data/streaming.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import REPO, chat_recipe

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


def test_a_plan_of_a_stream_counts_steps_from_max_steps_without_reading_it(tmp_path, tiny_llama_dir):
    """A stream has no length: the plan takes its steps from training.max_steps, and a step's batch is counted in
    packs and tokens (2 per device x 3 accumulated = 6 packs of up to 256 tokens)."""
    from hf_tune import load_recipe
    from hf_tune.commands.plan import format_plan
    from hf_tune.workflows.plan import plan

    recipe = streamed(tiny_llama_dir, tmp_path / "run", batch_tokens=256)
    recipe["training"].update(max_steps=6, per_device_train_batch_size=2, gradient_accumulation_steps=3)
    result = plan(load_recipe(recipe))
    assert result["examples"] is None and result["steps_per_epoch"] is None and result["total_steps"] == 6
    assert result["method_batch"].startswith("6 packs per step") and "at most 1,536 tokens" in result["method_batch"]
    text = format_plan(result)
    assert "streamed" in text and "total steps: 6" in text


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


def two_rank_stream(tmp_path, tiny_llama_dir, files: int, name: str = "run", **training) -> Path:
    """A streamed recipe over the first 24 demo chats, in ``files`` files of consecutive rows."""
    import yaml

    rows = (REPO / "examples" / "data" / "chat_demo.jsonl").read_text().splitlines()[:24]
    paths = []
    for f in range(files):
        paths.append(tmp_path / f"part{f}.jsonl")
        paths[-1].write_text("\n".join(rows[f * 24 // files:(f + 1) * 24 // files]) + "\n")
    recipe = streamed(tiny_llama_dir, tmp_path / name)
    recipe["training"].update({"max_steps": 3, **training})
    recipe["data"]["train"] = {"path": "json", "data_files": [str(p) for p in paths]}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def example_hashes(tokenizer, tiny_llama_dir, tmp_path) -> list[str]:
    """Each of the 24 chats' tokens, hashed as tests/ddp_probe.py hashes what a rank draws (map-style, in order)."""
    import hashlib

    import numpy as np

    from hf_tune import load_recipe
    from hf_tune.data import build_datasets

    recipe = chat_recipe(tiny_llama_dir, tmp_path / "whole")
    recipe["data"]["train"]["path"] = str(tmp_path / "all.jsonl")
    (tmp_path / "all.jsonl").write_text(
        "\n".join((REPO / "examples" / "data" / "chat_demo.jsonl").read_text().splitlines()[:24]) + "\n")
    whole, _ = build_datasets(load_recipe(recipe), tokenizer)
    return [hashlib.sha256(np.asarray(ids, dtype=np.int64).tobytes()).hexdigest()[:16] for ids in whole["input_ids"]]


@pytest.mark.slow
@pytest.mark.parametrize("files, rank_rows", [(1, lambda r: range(r, 24, 2)),  # one file: every other example
                                              (2, lambda r: range(12 * r, 12 * r + 12))])  # two: a file each
def test_each_rank_reads_its_own_share_of_the_stream(tmp_path, tiny_llama_dir, smol_tokenizer, files, rank_rows):
    """Two DDP processes on one stream: each draws exactly its share, computed here from the files (one example in
    two before tokenizing when there are fewer files than ranks, else whole files), none twice, and they train one
    model. Before hf_tune split a one-file stream itself, both ranks read and tokenized all 24 examples."""
    from conftest import free_port
    from runs import run_ranks as run

    recipe = two_rank_stream(tmp_path, tiny_llama_dir, files)
    result = run("torchrun", "--nproc_per_node", "2", "--master_port", str(free_port()), "tests/ddp_probe.py",
                 str(recipe))
    assert result.returncode == 0, result.stderr[-3000:]
    expected = example_hashes(smol_tokenizer, tiny_llama_dir, tmp_path)
    ranks = [json.loads((tmp_path / "run" / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r, seen in enumerate(ranks):
        assert seen["world_size"] == 2 and sorted(seen["examples"]) == sorted(expected[i] for i in rank_rows(r))
    assert ranks[0]["params_sha256"] == ranks[1]["params_sha256"]


@pytest.mark.slow
def test_a_two_rank_streamed_run_resumes_bit_exact(tmp_path, tiny_llama_dir):
    """Run A: 2 ranks, 4 steps on a one-file stream, saving at step 2. Run B resumes A's checkpoint-2 under the same
    launcher: each rank replays its share and skips its 2 batches, so B ends with A's weights, bit for bit."""
    from conftest import free_port
    from runs import run_ranks as run

    common = dict(max_steps=4, save_strategy="steps", save_steps=2, per_device_train_batch_size=1)
    recipes = {name: two_rank_stream(tmp_path, tiny_llama_dir, 1, name, **common) for name in "ab"}
    for name in "ab":
        if name == "b":
            (tmp_path / "b").mkdir()
            shutil.copytree(tmp_path / "a" / "checkpoint-2", tmp_path / "b" / "checkpoint-2")
        result = run("torchrun", "--nproc_per_node", "2", "--master_port", str(free_port()), "-m", "hf_tune.run",
                     str(recipes[name]))
        assert result.returncode == 0, result.stderr[-3000:]
    state = json.loads((tmp_path / "b" / "trainer_state.json").read_text())
    assert [log["step"] for log in state["log_history"] if "loss" in log] == [1, 2, 3, 4]
    a, b = final_weights(tmp_path / "a"), final_weights(tmp_path / "b")
    assert all(torch.equal(a[k], b[k]) for k in a)
