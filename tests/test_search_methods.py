"""Search spaces over the top-level keys: ``method`` (methods that read the recipe's data) and ``rewards`` (GRPO's
reward lists). Each choice is checked when the recipe loads; each trial trains its own method on data read for it."""

from __future__ import annotations

import pytest
from inputs import conversational_pairs, method_recipe

from hf_tune import load_recipe, search
from hf_tune.errors import RecipeError


def method_search(tiny_llama_dir, tmp_path, space: dict, method: str = "dpo", **data) -> dict:
    raw = method_recipe(method, tiny_llama_dir, conversational_pairs(tmp_path / "pairs.jsonl"), tmp_path / "study",
                        eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=2)
    raw["data"].update(eval_split=0.34, **data)
    raw["search"] = {"space": space, "n_trials": 2, "sampler": "grid", "pruner": "none"}
    return raw


def test_an_optuna_study_of_four_preference_methods_trains_each_method(tmp_path, tiny_llama_dir):
    methods = ["dpo", "kto", "orpo", "simpo"]  # with and without a reference model, paired and unpaired
    raw = method_search(tiny_llama_dir, tmp_path, {"method": {"type": "categorical", "choices": methods}})
    raw["search"]["n_trials"] = 4
    result = search(load_recipe(raw))
    trials = result["trials"]
    assert sorted(t["params"]["method"] for t in trials) == methods
    assert all(t["state"] == "COMPLETE" for t in trials)
    assert load_recipe(result["best_recipe"]).method == result["best"][0]["params"]["method"]


@pytest.mark.parametrize("space, key, message", [
    ({"method": {"type": "categorical", "choices": ["dpo", "sft"]}}, "search.space.method",
     "data.format is 'preference', but sft reads chat or instruction"),
    ({"method": {"type": "categorical", "choices": ["dpo", "dpoo"]}}, "search.space.method.choices[1]",
     "unknown method 'dpoo'"),
    ({"method": {"type": "categorical", "choices": ["dpo", "reward"]}}, "search.space.method.choices[1]",
     "model.task"),
    ({"rewards": {"type": "categorical", "choices": [["exact_answer"]]}}, "search.space.rewards.choices[0]",
     "only methods grpo and rloo use reward functions"),
])
def test_top_level_choices_are_each_checked_when_the_recipe_loads(tmp_path, tiny_llama_dir, space, key, message):
    with pytest.raises(RecipeError) as refused:
        load_recipe(method_search(tiny_llama_dir, tmp_path, space))
    assert refused.value.key == key and message in str(refused.value)


def test_grpo_reward_lists_are_searchable_and_a_bad_one_is_named(tmp_path, tiny_llama_dir):
    from conftest import DATA

    raw = method_search(tiny_llama_dir, tmp_path, {}, method="grpo")
    raw["data"] = {"train": {"path": str(DATA / "arithmetic_prompts.jsonl")}, "eval_split": 0.2}
    raw["training"].update(num_generations=2, per_device_eval_batch_size=2, max_completion_length=8)
    raw["rewards"] = ["exact_answer"]
    good = [["exact_answer"], ["exact_answer", {"name": "format_regex", "pattern": ".*\\d+"}]]
    raw["search"]["space"] = {"rewards": {"type": "categorical", "choices": good}}
    assert load_recipe(raw).search.space["rewards"].choices == good
    raw["search"]["space"]["rewards"]["choices"] = [["exact_answer"], [{"name": "format_regex"}]]
    with pytest.raises(RecipeError) as refused:
        load_recipe(raw)
    assert refused.value.key == "search.space.rewards.choices[1]" and "pattern" in str(refused.value)


def test_pbt_never_mutates_a_method(tmp_path, tiny_llama_dir, monkeypatch):
    """Ray Tune is not installed here: a stand-in module lets the recipe checks reach PBT's (they import nothing)."""
    import importlib.machinery
    import sys
    import types

    ray = types.ModuleType("ray")
    ray.__spec__ = importlib.machinery.ModuleSpec("ray", None)
    monkeypatch.setitem(sys.modules, "ray", ray)
    raw = method_search(tiny_llama_dir, tmp_path, {"method": {"type": "categorical", "choices": ["dpo", "kto"]},
                                                   "training.learning_rate": {"type": "float", "low": 1e-4,
                                                                              "high": 1e-3}})
    raw["search"].update(backend="ray", scheduler="pbt", sampler="random")
    with pytest.raises(RecipeError) as refused:
        load_recipe(raw)
    assert refused.value.key == "search.space.method" and "PBT mutates keys during a trial" in str(refused.value)


def test_a_study_of_grpo_and_rloo_trains_each_on_the_same_prompts_and_rewards(tmp_path, tiny_llama_dir):
    from conftest import DATA

    raw = method_search(tiny_llama_dir, tmp_path, {"method": {"type": "categorical", "choices": ["grpo", "rloo"]}},
                        method="grpo")
    raw["data"] = {"train": {"path": str(DATA / "arithmetic_prompts.jsonl")}, "eval_split": 0.2}
    raw["training"].update(num_generations=2, per_device_eval_batch_size=2, max_completion_length=4)
    raw["rewards"] = ["exact_answer"]
    result = search(load_recipe(raw))
    assert sorted(t["params"]["method"] for t in result["trials"]) == ["grpo", "rloo"]
    assert all(t["state"] == "COMPLETE" for t in result["trials"])


def test_a_distillation_study_searches_the_divergence_with_lora(tmp_path, tiny_llama_dir, smol_tokenizer):
    """beta 0 (forward KL) and 1 (reverse KL) of one student to one teacher: two trials, two different losses."""
    from conftest import DATA, save_tiny_llama

    teacher = save_tiny_llama(tmp_path / "teacher", smol_tokenizer, seed=1)
    raw = method_search(tiny_llama_dir, tmp_path, {"training.beta": {"type": "categorical", "choices": [0.0, 1.0]}},
                        method="distillation")
    raw["data"] = {"train": {"path": str(DATA / "arithmetic_prompts.jsonl")}, "eval_split": 0.2}
    raw["training"].update(max_completion_length=4)
    raw["teacher"] = {"pretrained_model_name_or_path": teacher}
    result = search(load_recipe(raw))
    trials = result["trials"]
    assert sorted(t["params"]["training.beta"] for t in trials) == [0.0, 1.0]
    assert all(t["state"] == "COMPLETE" for t in trials) and trials[0]["values"] != trials[1]["values"]
