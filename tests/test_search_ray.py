"""Search on Ray Tune: ASHA and population-based training over real Trainer runs of a tiny Llama, on one local Ray
instance started once for the session (its start-up counts against the suite's time)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import yaml
from inputs import ray_recipe, reported

from hf_tune import load_recipe, search, train
from hf_tune.errors import HfTuneError

ray = pytest.importorskip("ray")


@pytest.fixture(scope="session")
def local_ray():
    """One local Ray for every test here: hf_tune uses a Ray already running in the process and leaves it running."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"RAY_CHDIR_TO_TRIAL_DIR": "0", "TOKENIZERS_PARALLELISM": "false"}})
    yield ray
    ray.shutdown()


@pytest.mark.slow
def test_asha_stops_the_trials_its_rule_says_and_the_best_recipe_reproduces(tmp_path, tiny_llama_dir, local_ray):
    space = {"training.learning_rate": {"type": "categorical", "choices": [3e-2, 1e-2, 1e-6, 3e-6]}}
    raw = ray_recipe(tiny_llama_dir, tmp_path / "study", {
        "space": space, "scheduler": "asha",
        "scheduler_kwargs": {"grace_period": 1, "reduction_factor": 2, "max_concurrent_trials": 1}})
    result = search(load_recipe(raw))

    # ASHA's rule, applied independently to the losses Ray recorded: the trials run one after another; at each rung
    # (the 1st and 2nd evaluation; a trial reports at most 3) a trial stops when its loss is worse than the median of
    # the losses the earlier trials had at that rung.
    losses = {n: [row["eval_loss"] for row in rows] for n, rows in reported(Path(result["experiment_path"])).items()}
    assert sorted(losses) == [0, 1, 2, 3]
    stopped = set()
    for n, trial in losses.items():
        for rung in (1, 2):
            assert len(trial) >= rung, (n, losses)  # else it was stopped where the rule lets it go on
            earlier = [losses[m][rung - 1] for m in losses if m < n and len(losses[m]) >= rung]
            if earlier and trial[rung - 1] > np.percentile(earlier, 50):
                stopped.add(n)
                assert len(trial) == rung, (n, losses)  # it reported nothing after the rung that stopped it
                break
        else:
            assert len(trial) == 3, (n, losses)  # it trained to the end
    assert stopped, losses  # the weak trials were stopped early
    states = {t["number"]: t["state"] for t in result["trials"]}
    assert {n for n, s in states.items() if s == "PRUNED"} == stopped
    assert all(states[n] == "COMPLETE" for n in losses if n not in stopped)

    best = result["best"][0]
    assert best["values"][0] == min(losses[n][-1] for n in losses if n not in stopped)
    for name in ("best_recipe.yaml", "trials.csv", "learning_curves.png"):
        assert (tmp_path / "study" / name).is_file(), name
    best_raw = yaml.safe_load(Path(result["best_recipe"]).read_text())
    assert "search" not in best_raw and best_raw["training"]["learning_rate"] == best["params"]["training.learning_rate"]
    train(load_recipe(result["best_recipe"]))  # validates, and trains the same steps again, outside Ray
    rerun = json.loads((tmp_path / "study" / "best" / "eval_results.json").read_text())
    assert rerun["eval_loss"] == pytest.approx(best["values"][0], abs=1e-5)


def adapter(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(folder / "adapter_model.safetensors"))


@pytest.mark.slow
def test_pbt_exploit_copies_the_donor_checkpoint_and_trains_on_with_the_mutated_value(tmp_path, tiny_llama_dir,
                                                                                    local_ray):
    import torch

    low, high = 1e-3, 3e-2
    space = {"training.learning_rate": {"type": "float", "low": low, "high": high, "log": True}}
    raw = ray_recipe(tiny_llama_dir, tmp_path / "study", {
        "space": space, "scheduler": "pbt", "n_trials": 2,
        "scheduler_kwargs": {"perturbation_interval": 1, "quantile_fraction": 0.5, "resample_probability": 0.0}})
    result = search(load_recipe(raw))
    experiment = Path(result["experiment_path"])

    policy = [json.loads(line) for line in (experiment / "pbt_global.txt").read_text().splitlines()]
    assert policy, "no trial exploited another"
    assert len(result["exploits"]) == len(policy)
    for target, donor, _, _, donor_config, new_config in policy:
        # the mutation rule: the donor's value x 1.2 or x 0.8 (resample_probability 0), kept inside the space
        old = donor_config["training.learning_rate"]
        assert any(new_config["training.learning_rate"] == pytest.approx(min(max(old * f, low), high), rel=1e-9)
                   for f in (1.2, 0.8)), (old, new_config)

    # the last exploit: the trial's folder holds the checkpoint Ray handed it, which is one of the donor's (Ray's
    # own folder for that trial), tensor for tensor
    target, donor, _, _, donor_config, new_config = policy[-1]
    number, donor_number = int(target.split("_")[0]), int(donor.split("_")[0])
    adopted = json.loads((tmp_path / "study" / f"trial-{number}" / "adopted_checkpoints.jsonl").read_text()
                         .splitlines()[-1])
    donor_checkpoint, step = Path(adopted["from"]), adopted["step"]
    assert step < 6  # a trial is stopped at its last step, before PBT could exploit
    assert f"_{donor_number:05d}_" in donor_checkpoint.parent.name
    assert json.loads((donor_checkpoint / "trainer_state.json").read_text())["global_step"] == step
    copied = adapter(tmp_path / "study" / f"trial-{number}" / f"checkpoint-{step}")
    original = adapter(donor_checkpoint)
    assert copied.keys() == original.keys() and all(torch.equal(copied[k], original[k]) for k in original)

    # and it trained on from the donor's state with the mutated learning rate (a resumed optimizer would otherwise
    # keep the donor's): its log up to the exploit is the donor's, after it the mutated peak on the same cosine
    final = json.loads((tmp_path / "study" / f"trial-{number}" / "checkpoint-6" / "trainer_state.json").read_text())
    donor_log = json.loads((donor_checkpoint / "trainer_state.json").read_text())["log_history"]
    assert [h for h in final["log_history"] if h["step"] <= step] == donor_log
    rates = {h["step"]: h["learning_rate"] for h in final["log_history"] if "learning_rate" in h}
    new_peak = new_config["training.learning_rate"]
    for s in range(step + 1, 7):  # the rate logged at step s is the one step s trained with: cosine from 1 to 0
        assert rates[s] == pytest.approx(new_peak * 0.5 * (1 + math.cos(math.pi * (s - 1) / 6)), rel=1e-6), rates

    schedule = (tmp_path / "study" / "pbt_schedule.csv").read_text().splitlines()
    assert schedule[0] == "trial,step,training.learning_rate" and len(schedule) > 1
    assert (tmp_path / "study" / "pbt_schedule.png").is_file()
    load_recipe(result["best_recipe"])


def test_pbt_needs_a_key_it_can_mutate(tmp_path, tiny_llama_dir):
    """lora and model keys shape the weights a trial copies: PBT never mutates them, so a space of those alone
    leaves it nothing to do."""
    from hf_tune.search.ray_backend import make_scheduler

    raw = ray_recipe(tiny_llama_dir, tmp_path / "s", {"space": {"lora.r": {"type": "categorical", "choices": [2, 4]}},
                                                      "scheduler": "pbt"})
    with pytest.raises(HfTuneError, match="search.space: PBT mutates training and optim keys"):
        load_recipe(raw)
    raw["search"]["space"]["training.learning_rate"] = {"type": "float", "low": 1e-4, "high": 1e-2, "log": True}
    pbt = make_scheduler(load_recipe(raw).search, "eval_loss", "min", 3)
    assert list(pbt._hyperparam_mutations) == ["training.learning_rate"]


def test_ray_settings_need_the_ray_backend(tmp_path, tiny_llama_dir):
    raw = ray_recipe(tiny_llama_dir, tmp_path / "s", {"space": {"lora.r": {"type": "categorical", "choices": [2, 4]}},
                                                      "scheduler": "asha"})
    raw["search"]["backend"] = "optuna"
    with pytest.raises(HfTuneError, match="search.scheduler: applies to search.backend: ray"):
        load_recipe(raw)


def test_ray_grid_takes_categorical_keys_and_gives_each_combination_once(tmp_path, tiny_llama_dir):
    from hf_tune.search.ray_backend import param_space

    raw = ray_recipe(tiny_llama_dir, tmp_path / "s", {"space": {
        "training.learning_rate": {"type": "float", "low": 1e-4, "high": 1e-2}}, "sampler": "grid"})
    with pytest.raises(HfTuneError, match="search.sampler: grid on backend ray takes categorical keys"):
        load_recipe(raw)
    raw["search"]["space"] = {"training.learning_rate": {"type": "categorical", "choices": [1e-3, 1e-2]},
                              "lora.target_modules": {"type": "categorical", "choices": [["q_proj"], "all-linear"]}}
    space = param_space(load_recipe(raw).search)
    assert space["lora.target_modules"] == {"grid_search": [["q_proj"], "all-linear"]}


@pytest.mark.slow
def test_a_dpo_recipe_searches_beta_on_ray_with_one_trainer_per_trial(tmp_path, tiny_llama_dir, local_ray):
    from inputs import conversational_pairs, method_recipe

    raw = method_recipe("dpo", tiny_llama_dir, conversational_pairs(tmp_path / "p.jsonl"), tmp_path / "study",
                        max_steps=4, eval_strategy="steps", eval_steps=2, learning_rate=1e-3)
    raw["data"]["eval_split"] = 0.34
    raw["search"] = {"backend": "ray", "n_trials": 2, "metric": "eval_rewards/accuracies",
                     "space": {"training.beta": {"type": "categorical", "choices": [0.05, 0.5]}},
                     "scheduler": "none", "scheduler_kwargs": {"max_concurrent_trials": 1}}
    result = search(load_recipe(raw))
    best = load_recipe(tmp_path / "study" / "best_recipe.yaml")
    assert best.method == "dpo" and best.training["beta"] in (0.05, 0.5)
    losses = {n: [row["eval_loss"] for row in rows] for n, rows in reported(Path(result["experiment_path"])).items()}
    assert len(losses) == 2 and all(len(v) == 2 for v in losses.values())  # both trials evaluated at steps 2 and 4
