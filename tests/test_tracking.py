"""Tracker settings belong to one run: two runs in one process (a notebook, the folds of cv) get two tracker runs."""

from __future__ import annotations

import os

from conftest import chat_recipe

from hf_tune import load_recipe, train
from hf_tune.records.tracking import TRACKER_ENV


def test_two_runs_in_one_process_get_two_wandb_runs_each_in_its_own_folder(tmp_path, tiny_llama_dir, monkeypatch):
    for key in TRACKER_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")  # the user's choice: kept for both runs
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_PROJECT", "notebook-project")  # also the user's: wins over the recipe's
    before = {key: os.environ.get(key) for key in TRACKER_ENV}
    ids = []
    for name in ("first", "second"):
        raw = chat_recipe(tiny_llama_dir, tmp_path / name, max_steps=1, report_to="wandb")
        raw["tracking"] = {"project": "from-recipe", "name": name}
        trainer = train(load_recipe(raw))
        assert "eval_loss" in trainer.evaluate(trainer.train_dataset)  # the returned trainer still works: it no
        # longer reports to the W&B run it closed (wandb.log without a run would raise)
        run_id = (tmp_path / name / "wandb_run_id").read_text().strip()
        logged = list((tmp_path / name / "wandb").glob("offline-run-*"))
        assert [p.name.endswith(f"-{run_id}") for p in logged] == [True], logged  # this run's id, in its folder
        ids.append(run_id)
        assert {key: os.environ.get(key) for key in TRACKER_ENV} == before  # nothing of the run stays behind
    assert ids[0] != ids[1]
    assert not list((tmp_path / "first" / "wandb").glob(f"*{ids[1]}*"))


def test_trackio_logs_locally_under_the_recipes_project_and_run_name(tmp_path, tiny_llama_dir, monkeypatch):
    import json
    import uuid

    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))  # read when trackio is first imported
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # local-first: no Space, no account, no network
    project = f"local-{uuid.uuid4().hex[:8]}"
    run_dir = tmp_path / "run"
    raw = chat_recipe(tiny_llama_dir, run_dir, max_steps=3, report_to="trackio")
    raw["tracking"] = {"project": project, "name": "trackio-run"}
    train(load_recipe(raw))
    from trackio.sqlite_storage import SQLiteStorage

    assert SQLiteStorage.get_runs(project) == ["trackio-run"]
    logged = {e["train/global_step"]: e["train/loss"] for e in SQLiteStorage.get_logs(project, "trackio-run")
              if "train/loss" in e}
    history = json.loads((run_dir / "trainer_state.json").read_text())["log_history"]
    assert logged == {e["step"]: e["loss"] for e in history if "loss" in e}  # every step's loss, as Trainer logged it
    assert sorted(logged) == [1, 2, 3]
