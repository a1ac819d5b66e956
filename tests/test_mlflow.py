"""MLflow, read back through ``MlflowClient``: the run folder's own store and a real local tracking server get the
recipe's run name and tags, the flattened recipe and lineage as params, per-step metrics and the run folder's files;
a killed run resumed continues its MLflow run; two runs in one process are two MLflow runs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import launch
import pytest
import yaml
from conftest import chat_recipe

from hf_tune import load_recipe, train
from hf_tune.commands.cli import main as hf_tune_cli
from hf_tune.records.lineage import flat_lineage, read_lineage
from hf_tune.records.model_card import render_model_card
from hf_tune.records.tracking import TRACKER_ENV
from hf_tune.trainer.checkpoints import is_complete

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")


@pytest.fixture(autouse=True)
def clean_tracker_env(monkeypatch):
    for key in TRACKER_ENV:
        monkeypatch.delenv(key, raising=False)


def client_for(uri: str):
    from mlflow import MlflowClient

    return MlflowClient(uri)


def runs_of(client, experiment: str) -> list:
    found = client.get_experiment_by_name(experiment)
    return [] if found is None else client.search_runs([found.experiment_id], order_by=["attributes.start_time"])


def logged_losses(run_dir: Path) -> dict[int, float]:
    """Each step's training loss, as Trainer's own log history in the run folder has it."""
    history = json.loads((run_dir / "trainer_state.json").read_text())["log_history"]
    return {e["step"]: e["loss"] for e in history if "loss" in e}


def flatten(value, prefix: str = "") -> dict[str, str]:
    """The test's own flattening of a YAML mapping: dotted keys, text values, lists as JSON."""
    if isinstance(value, dict) and value:
        out = {}
        for key, item in value.items():
            out.update(flatten(item, f"{prefix}.{key}" if prefix else key))
        return out
    return {prefix: value if isinstance(value, str) else json.dumps(value)}


def test_the_run_folder_store_gets_the_recipes_name_tags_params_step_metrics_and_files(tmp_path, tiny_llama_dir):
    run_dir = tmp_path / "run"
    raw = chat_recipe(tiny_llama_dir, run_dir, max_steps=3, report_to="mlflow")
    raw["lora"] = {"r": 4, "lora_alpha": 8, "target_modules": "all-linear"}
    raw["tracking"] = {"project": "my-project", "name": "lora-r4", "group": "ablation", "tags": ["lora", "team=nlp"]}
    train(load_recipe(raw))
    assert "MLFLOW_TRACKING_URI" not in os.environ  # the run's settings did not outlive it

    client = client_for(f"sqlite:///{run_dir / 'mlruns' / 'mlflow.db'}")
    [run] = runs_of(client, "my-project")
    assert run.info.run_name == "lora-r4" and run.info.status == "FINISHED"
    assert {k: run.data.tags[k] for k in ("lora", "team", "group")} == {"lora": "", "team": "nlp", "group": "ablation"}
    params = run.data.params
    recipe = yaml.safe_load((run_dir / "recipe.yaml").read_text())
    assert {k: params.get(k) for k in flatten(recipe)} == flatten(recipe)  # every key of the resolved recipe
    assert params["lora.r"] == "4" and params["training.learning_rate"] == "0.001"
    manifest = json.loads((run_dir / "run.json").read_text())
    commit = launch.run("git", "rev-parse", "HEAD").stdout.strip()
    assert params["git.commit"] == commit
    assert params["datasets.train.fingerprint"] == manifest["datasets"]["train"]["fingerprint"]
    assert params["base_model.name_or_path"] == tiny_llama_dir
    assert params["packages.transformers"] == manifest["packages"]["transformers"]
    lineage = flat_lineage(read_lineage(run_dir))  # run.json's lineage fields, each one an MLflow param
    assert {k: params.get(k) for k in lineage if k != "git.dirty"} == {k: v for k, v in lineage.items()
                                                                        if k != "git.dirty"}

    history = client.get_metric_history(run.info.run_id, "loss")
    assert {m.step: m.value for m in history} == pytest.approx(logged_losses(run_dir))
    assert sorted(logged_losses(run_dir)) == [1, 2, 3]
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"recipe.yaml", "run.json", "loss.png", "lr.png"} <= artifacts
    copy = client.download_artifacts(run.info.run_id, "run.json", str(tmp_path))
    assert json.loads(Path(copy).read_text()) == manifest  # the finished manifest, end_time included
    assert manifest["end_time"]

    card = render_model_card(run_dir, "me/lora-r4").content  # the card carries the same lineage fields
    for key in ("git.commit", "datasets.train.fingerprint", "base_model.name_or_path"):
        assert f"| {key} | `{params[key]}`" in card


def test_a_plain_file_store_named_by_mlflow_tracking_uri_gets_the_run(tmp_path, tiny_llama_dir, monkeypatch):
    store = (tmp_path / "file-store").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 refuses a file store without it
    run_dir = tmp_path / "run"
    raw = chat_recipe(tiny_llama_dir, run_dir, max_steps=2, report_to="mlflow")
    raw["tracking"] = {"name": "in-a-file-store", "tags": ["file"]}
    train(load_recipe(raw))
    client = client_for(store)
    [run] = client.search_runs(["0"])  # no project: MLflow's Default experiment
    assert run.info.run_name == "in-a-file-store" and "file" in run.data.tags and run.info.status == "FINISHED"
    history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "loss")}
    assert history == pytest.approx(logged_losses(run_dir))
    assert json.loads((run_dir / "mlflow_run_id").read_text()) == {store: run.info.run_id}
    assert not (run_dir / "mlruns").exists()


@pytest.mark.slow
def test_two_runs_in_one_process_are_two_runs_on_a_tracking_server(tmp_path, tiny_llama_dir, mlflow_server,
                                                                     monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    experiment = f"two-runs-{uuid.uuid4().hex[:8]}"
    for name in ("first", "second"):
        raw = chat_recipe(tiny_llama_dir, tmp_path / name, max_steps=2, report_to="mlflow")
        raw["tracking"] = {"project": experiment, "name": name}
        train(load_recipe(raw))
        assert os.environ["MLFLOW_TRACKING_URI"] == mlflow_server
        assert not (tmp_path / name / "mlruns").exists()  # the server is the store, not the run folder
    client = client_for(mlflow_server)
    runs = runs_of(client, experiment)
    assert [r.info.run_name for r in runs] == ["first", "second"]
    assert runs[0].info.run_id != runs[1].info.run_id
    for run, name in zip(runs, ("first", "second")):
        history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "loss")}
        assert history == pytest.approx(logged_losses(tmp_path / name))  # each run's own losses only
        assert run.data.params["training.output_dir"] == str(tmp_path / name)


@pytest.mark.slow
def test_a_killed_run_resumed_continues_the_same_mlflow_run(tmp_path, tiny_llama_dir, mlflow_server, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    experiment = f"resume-{uuid.uuid4().hex[:8]}"
    run_dir = tmp_path / "run"
    raw = chat_recipe(tiny_llama_dir, run_dir, max_steps=10, report_to="mlflow", save_strategy="steps",
                      save_steps=2)
    raw["tracking"] = {"project": experiment, "name": "resumed"}
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    proc = launch.start("python", "-m", "hf_tune.run", str(recipe), stdout=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not is_complete(run_dir / "checkpoint-2"):
        assert proc.poll() is None and time.time() < deadline, proc.stderr.read()[-3000:]
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not json.loads((run_dir / "run.json").read_text())["end_time"]  # killed before the end
    client = client_for(mlflow_server)
    [killed] = runs_of(client, experiment)
    assert killed.info.status == "RUNNING"  # what a kill leaves on the server

    train(load_recipe(str(recipe)))  # the same command again: resumes from checkpoint-2
    [run] = runs_of(client, experiment)
    assert run.info.run_id == killed.info.run_id and run.info.status == "FINISHED"
    assert run.info.run_name == "resumed"
    steps = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "loss")}
    assert sorted(steps) == list(range(1, 11))  # the killed process's steps, then the resumed ones
    resumed = logged_losses(run_dir)
    assert {s: steps[s] for s in range(3, 11)} == pytest.approx({s: resumed[s] for s in range(3, 11)})


@pytest.mark.slow
def test_register_promote_and_load_by_alias_gives_the_runs_logits(tmp_path, tiny_llama_dir, mlflow_server,
                                                                    monkeypatch, capsys):
    import mlflow
    import torch
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoTokenizer

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    experiment, model_name = f"registry-{uuid.uuid4().hex[:8]}", f"tiny-{uuid.uuid4().hex[:8]}"
    run_dir = tmp_path / "run"
    raw = chat_recipe(tiny_llama_dir, run_dir, max_steps=2, report_to="mlflow", learning_rate=0.05)
    raw["lora"] = {"r": 4, "lora_alpha": 8, "target_modules": "all-linear"}
    raw["tracking"] = {"project": experiment, "name": "registered"}
    train(load_recipe(raw))
    training_run = json.loads((run_dir / "mlflow_run_id").read_text())[mlflow_server]

    hf_tune_cli(["register", str(run_dir), "--name", model_name, "--alias", "staging"])
    hf_tune_cli(["register", str(run_dir), "--name", model_name, "--alias", "staging"])  # version 2 takes staging
    hf_tune_cli(["promote", model_name, "1", "--alias", "production"])
    assert f"{model_name}@production -> version 1" in capsys.readouterr().out

    client = client_for(mlflow_server)
    assert client.get_model_version_by_alias(model_name, "staging").version == "2"
    production = client.get_model_version_by_alias(model_name, "production")
    assert production.version == "1" and production.run_id == training_run  # logged into the run that trained it
    params = client.get_run(training_run).data.params
    for key in ("git.commit", "datasets.train.fingerprint", "base_model.name_or_path", "lora.r",
                "training.learning_rate"):
        assert production.tags[key] == params[key]  # the registry entry carries the run's lineage
    info = mlflow.models.get_model_info(f"models:/{model_name}@production")
    assert info.signature is not None and info.signature.inputs.input_names()

    components = mlflow.transformers.load_model(f"models:/{model_name}@production", return_type="components")
    tokenizer = AutoTokenizer.from_pretrained(run_dir)
    batch = tokenizer(["The capital of Norway is", "hello"], return_tensors="pt", padding=True)
    with torch.no_grad():
        expected = AutoPeftModelForCausalLM.from_pretrained(run_dir).eval()(**batch).logits  # base + adapter
        loaded = components["model"].eval()(**batch).logits
    assert expected.abs().max() > 0
    torch.testing.assert_close(loaded, expected, rtol=1e-5, atol=1e-5)
    assert "MLFLOW_TRACKING_URI" in os.environ and os.environ["MLFLOW_TRACKING_URI"] == mlflow_server
    import mlflow

    monkeypatch.delenv("MLFLOW_TRACKING_URI")  # the process's URI follows the variable again: nothing pinned it
    assert mlflow.get_tracking_uri() != mlflow_server


@pytest.mark.slow
def test_every_flattened_key_is_one_mlflow_takes(mlflow_server):
    from mlflow.entities import Param

    from hf_tune.records.lineage import flat_lineage

    lineage = {"recipe": {"lora": {"rank_pattern": {"^model.*q_proj$": 8}, "target_modules": ["q_proj", "v_proj"]}},
               "datasets": {"train[0]": {"fingerprint": "abc"}, "eval": {"fingerprint": "def"}}}
    flat = flat_lineage(lineage)
    assert flat["lora.target_modules"] == '["q_proj", "v_proj"]' and flat["datasets.train.0.fingerprint"] == "abc"
    client = client_for(mlflow_server)
    run = client.create_run("0")
    client.log_batch(run.info.run_id, params=[Param(k, v) for k, v in flat.items()])  # MLflow's own name rules
    assert client.get_run(run.info.run_id).data.params == flat


def test_promote_on_a_mistyped_store_path_is_refused_and_creates_no_store(tmp_path, capsys):
    from hf_tune.commands.cli import main

    store = tmp_path / "run" / "mlruns" / "mlfow.db"  # a typo of mlflow.db
    (tmp_path / "run" / "mlruns").mkdir(parents=True)
    with pytest.raises(SystemExit) as refused:
        main(["promote", "tiny", "1", "--alias", "production", "--tracking-uri", f"sqlite:///{store}"])
    err = capsys.readouterr().err
    assert refused.value.code == 2 and f"{store} does not exist" in err and "fix:" in err
    assert not store.exists() and not list((tmp_path / "run" / "mlruns").iterdir())  # no empty store made beside
