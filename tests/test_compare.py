"""``hf-tune compare``: the recipe keys that differ, final metrics, tokens/s and peak memory of real runs, their curves
in one PNG; a study folder stands for its trials."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import optuna
import pytest
from conftest import chat_recipe
from matplotlib import image

from hf_tune import load_recipe, train
from hf_tune.commands.cli import main as hf_tune_cli
from hf_tune.search.compare import collect_runs, compare_runs, plot_comparison


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory, tiny_llama_dir):
    folder = tmp_path_factory.mktemp("compare")
    runs = []
    for name, lr in (("slow", 1e-4), ("fast", 3e-3)):
        raw = chat_recipe(tiny_llama_dir, folder / name, max_steps=3, learning_rate=lr)  # evaluated at the end
        raw["data"]["eval_split"] = 0.2
        train(load_recipe(raw))
        runs.append(folder / name)
    return runs


def test_the_table_has_only_the_differing_keys_and_each_runs_results(two_runs):
    table = compare_runs(two_runs)
    assert list(table.index) == [str(p) for p in two_runs]
    assert table["training.learning_rate"].tolist() == [1e-4, 3e-3]
    assert not [c for c in table.columns if c in ("training.max_steps", "model.pretrained_model_name_or_path",
                                                  "training.output_dir", "data.format")]  # the same in both
    for run in two_runs:
        results = json.loads((run / "all_results.json").read_text())  # what Trainer wrote, read independently
        row = table.loc[str(run)]
        assert row["train_loss"] == pytest.approx(results["train_loss"])
        assert row["eval_loss"] == pytest.approx(results["eval_loss"])
        assert row["tokens/s"] == pytest.approx(results["train_tokens_per_second"])
        assert row["peak memory (GB)"] == pytest.approx(results["train_peak_memory_gb"])


def test_the_cli_prints_the_table_and_draws_both_runs_curves(two_runs, tmp_path, capsys):
    out = tmp_path / "compare.png"
    hf_tune_cli(["compare", *map(str, two_runs), "--out", str(out)])
    printed = capsys.readouterr().out
    assert "training.learning_rate" in printed and f"curves: {out}" in printed
    pixels = image.imread(out)
    assert pixels.shape[0] > 200 and pixels.shape[1] > 500
    runs = collect_runs(two_runs)
    for run in runs:  # both curves of both runs: steps 1..3 of the loss, the eval at step 3
        assert run.curves["loss"][0] == [1, 2, 3] and run.curves["eval_loss"][0] == [3]
    for colour in ((31, 119, 180), (255, 127, 14)):  # matplotlib's first two colours: one per run
        assert (np.abs(pixels[..., :3] - np.array(colour) / 255).max(axis=-1) < 0.02).sum() > 50


def test_a_study_folder_stands_for_its_trials(tmp_path):
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    study = optuna.create_study(study_name="lr", storage=storage, direction="minimize")
    for lr, losses in ((1e-4, [2.0, 1.8]), (1e-3, [1.5, 1.1]), (1e-2, [3.0])):
        study.enqueue_trial({"training.learning_rate": lr})
        trial = study.ask({"training.learning_rate": optuna.distributions.FloatDistribution(1e-5, 1e-1, log=True)})
        for step, loss in enumerate(losses, start=1):
            trial.report(loss, step)
        if len(losses) == 1:
            study.tell(trial, state=optuna.trial.TrialState.PRUNED)
        else:
            study.tell(trial, losses[-1])
    table = compare_runs([tmp_path])
    assert list(table.index) == [f"{tmp_path}/trial-{i}" for i in range(3)]
    assert table["training.learning_rate"].tolist() == pytest.approx([1e-4, 1e-3, 1e-2])
    assert table["value"].tolist()[:2] == [1.8, 1.1] and table["state"].tolist() == ["complete", "complete", "pruned"]
    runs = collect_runs([tmp_path])
    assert runs[1].curves["value"] == ([1, 2], [1.5, 1.1])  # the reported curve of each trial
    assert plot_comparison(runs, tmp_path / "trials.png").stat().st_size > 0


@pytest.fixture(scope="module")
def ray_study(tmp_path_factory, tiny_llama_dir):
    """A tiny Ray Tune study (two trials, one after another), on the local Ray of tests/test_search_ray.py when it
    runs in this session, else on one started here."""
    ray = pytest.importorskip("ray")
    from inputs import ray_recipe

    from hf_tune import search

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"RAY_CHDIR_TO_TRIAL_DIR": "0", "TOKENIZERS_PARALLELISM": "false"}})
    try:
        study = tmp_path_factory.mktemp("ray") / "study"
        space = {"training.learning_rate": {"type": "categorical", "choices": [1e-3, 3e-2]}}
        raw = ray_recipe(tiny_llama_dir, study, {"space": space, "n_trials": 2, "sampler": "grid", "scheduler": "none",
                                                 "scheduler_kwargs": {"max_concurrent_trials": 1}},
                         max_steps=4, save_strategy="steps", save_steps=2)
        result = search(load_recipe(raw))
    finally:
        if started:
            ray.shutdown()
    return study, result


@pytest.mark.slow
def test_a_ray_study_folder_stands_for_its_trials_as_an_optuna_one_does(ray_study, tmp_path, capsys):
    from inputs import reported

    study, result = ray_study
    rows = reported(Path(result["experiment_path"]))  # Ray's own record of each trial's reports, read independently
    assert sorted(rows) == [0, 1]
    table = compare_runs([study])
    assert list(table.index) == [f"{study}/trial-{n}" for n in (0, 1)]
    assert table["training.learning_rate"].tolist() == [rows[n][-1]["config"]["training.learning_rate"] for n in (0, 1)]
    assert table["value"].tolist() == pytest.approx([rows[n][-1]["eval_loss"] for n in (0, 1)])
    assert table["state"].tolist() == ["complete", "complete"]
    runs = collect_runs([study])
    for n, run in enumerate(runs):  # the reported curve (evaluations at steps 2 and 4), and the training loss of the
        assert run.curves["eval_loss"] == ([2, 4], [row["eval_loss"] for row in rows[n]])  # last checkpoint kept
        assert run.curves["loss"][0][:2] == [1, 2]
    out = tmp_path / "ray.png"
    hf_tune_cli(["compare", str(study), "--out", str(out)])
    assert "training.learning_rate" in capsys.readouterr().out and out.stat().st_size > 0
