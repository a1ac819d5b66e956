"""Profiling: ``hf-tune profile RECIPE`` writes a Chrome trace with events for every linear layer of the model, a
top-operators table that adds up to the profiled step time, and step-time shares, into a folder of its own; the
recipe's ``profile`` section does the same inside a training run."""

from __future__ import annotations

import csv
import json

import pytest
import yaml
from conftest import chat_recipe, write_recipe

from hf_tune import load_recipe, train
from hf_tune.commands.cli import main as hf_tune_cli
from hf_tune.errors import RecipeError


def linear_weight_shapes(model_dir: str) -> set[tuple[int, int]]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    return {tuple(m.weight.shape) for m in model.modules() if isinstance(m, torch.nn.Linear)}


def test_hf_tune_profile_writes_a_trace_of_the_linear_layers_and_a_table_that_sums_to_the_step_time(
        tmp_path, tiny_llama_dir, capsys):
    run_dir = tmp_path / "run"
    raw = chat_recipe(tiny_llama_dir, run_dir, max_steps=100)
    raw["profile"] = {"wait": 1, "warmup": 1, "active": 2}
    hf_tune_cli(["profile", str(write_recipe(tmp_path / "recipe.yaml", raw))])
    printed = capsys.readouterr().out
    assert not run_dir.exists()  # the real run folder is not touched
    folder = tmp_path / "run-profile" / "profile"
    assert f"trace: {folder / 'trace.json'}" in printed and "share of step time: matmul" in printed

    events = json.loads((folder / "trace.json").read_text())["traceEvents"]  # valid JSON, Chrome's trace format
    steps = [e for e in events if e.get("name", "").startswith("ProfilerStep#")]
    assert len(steps) == 2  # the active steps only
    linear_inputs = [e["args"]["Input Dims"] for e in events if e.get("name") == "aten::linear"]
    traced = {tuple(dims[1]) for dims in linear_inputs}  # (out, in) of the weight each linear call multiplied
    assert linear_weight_shapes(tiny_llama_dir) <= traced  # every linear layer of the model, the LM head included

    with (folder / "top_ops.csv").open() as f:
        rows = list(csv.DictReader(f))
    step_ms = sum(e["dur"] for e in steps) / 1e3  # the trace's own step spans, in microseconds
    assert sum(float(r["self_ms"]) for r in rows) == pytest.approx(step_ms, rel=0.05)
    self_ms = [float(r["self_ms"]) for r in rows[:-1]]
    assert self_ms == sorted(self_ms, reverse=True)  # top operators first
    summary = json.loads((folder / "profile.json").read_text())
    assert summary["steps"] == 2 and sum(summary["shares"].values()) == pytest.approx(1, abs=1e-3)
    assert summary["shares"]["matmul"] > 0 and summary["shares"]["optimizer"] > 0


def test_a_profile_section_profiles_a_training_run_into_its_folder(tmp_path, tiny_llama_dir):
    raw = chat_recipe(tiny_llama_dir, tmp_path / "run", max_steps=3)
    raw["profile"] = {"wait": 0, "warmup": 1, "active": 1}
    train(load_recipe(raw))
    assert json.loads((tmp_path / "run" / "profile" / "trace.json").read_text())["traceEvents"]
    assert yaml.safe_load((tmp_path / "run" / "recipe.yaml").read_text())["profile"]["active"] == 1
    assert json.loads((tmp_path / "run" / "run.json").read_text())["end_time"]  # the run itself went on to its end


def test_a_profile_key_that_does_not_exist_is_refused_by_name(tmp_path, tiny_llama_dir):
    raw = chat_recipe(tiny_llama_dir, tmp_path / "run")
    raw["profile"] = {"activ": 3}
    with pytest.raises(RecipeError, match="profile.activ"):
        load_recipe(raw)
