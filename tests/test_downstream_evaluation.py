"""Downstream evaluation in the loop (hf_tune.evaluation): lm-eval scores of the model in memory equal lm-eval's own
CLI on the saved checkpoint; early stopping on a downstream score stops where the logged scores say; generation
samples equal plain greedy generation from the checkpoint and reach MLflow; offline refusals; the recipe checks."""

from __future__ import annotations

import json
from pathlib import Path

import launch
import pytest
from conftest import chat_recipe

from hf_tune import load_recipe, train
from hf_tune.errors import HfTuneError
from hf_tune.recipe.evaluation_tasks import SHIPPED_TASKS_DIR
from hf_tune.records.tracking import TRACKER_ENV

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")

TASK, LIMIT, PATIENCE, MAX_STEPS = "hf_tune_arithmetic", 4, 1, 6
METRIC = f"eval_{TASK}_acc"
PROMPTS = ["What is 12 + 30?", "Name a colour."]


def downstream_recipe(model: str, out: Path, **training) -> dict:
    settings = dict(max_steps=MAX_STEPS, learning_rate=3e-2, eval_strategy="steps", eval_steps=1,
                    save_strategy="steps", save_steps=1, metric_for_best_model=METRIC, greater_is_better=True,
                    load_best_model_at_end=True, per_device_eval_batch_size=4, seed=0)
    raw = chat_recipe(model, out, **{**settings, **training})
    raw["data"]["eval_split"] = 0.05
    raw["evaluation"] = {"tasks": [TASK], "limit": LIMIT, "batch_size": 4, "early_stopping_patience": PATIENCE,
                         "samples": PROMPTS, "sample_max_new_tokens": 6}
    return raw


@pytest.fixture(scope="module")
def scored_run(tmp_path_factory, tiny_llama_dir):
    """One short run of the tiny Llama scored on the shipped task at every step, with early stopping on its accuracy,
    samples, MLflow (the run folder's own store) and W&B (offline)."""
    run_dir = tmp_path_factory.mktemp("scored") / "run"
    with pytest.MonkeyPatch.context() as env:
        for key in TRACKER_ENV:
            env.delenv(key, raising=False)
        env.setenv("WANDB_MODE", "offline")
        env.setenv("WANDB_SILENT", "true")
        trainer = train(load_recipe(downstream_recipe(tiny_llama_dir, run_dir, report_to=["mlflow", "wandb",
                                                                                         "tensorboard"])))
    history = json.loads((run_dir / "trainer_state.json").read_text())["log_history"]
    return run_dir, trainer.state.global_step, history


def evaluations(history: list[dict]) -> list[dict]:
    """The periodic evaluations (the final evaluate after training repeats the last step's)."""
    seen, out = set(), []
    for entry in history:
        if METRIC in entry and entry["step"] not in seen:
            seen.add(entry["step"])
            out.append(entry)
    return out


def lm_eval_cli(checkpoint: Path, out: Path) -> dict:
    """lm-eval's own command line on a saved checkpoint: the independent scorer."""
    launch.run("python", "-m", "lm_eval", "--model", "hf", "--model_args", f"pretrained={checkpoint},dtype=float32",
               "--device", "cpu", "--tasks", TASK, "--include_path", str(SHIPPED_TASKS_DIR), "--limit", str(LIMIT),
               "--batch_size", "4", "--output_path", str(out), check=True, timeout=300)
    [results] = out.rglob("results_*.json")
    return json.loads(results.read_text())["results"][TASK]


def lm_eval_in_process(checkpoint: Path) -> dict:
    """lm-eval's ``simple_evaluate`` loading the checkpoint itself (its ``hf`` model by path)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    results = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={checkpoint},dtype=float32", device="cpu",
                                      tasks=[TASK], limit=LIMIT, batch_size=4, bootstrap_iters=0,
                                      task_manager=TaskManager(include_path=str(SHIPPED_TASKS_DIR),
                                                               include_defaults=False))
    return results["results"][TASK]


def test_the_logged_score_equals_lm_evals_cli_on_the_saved_checkpoint(scored_run, tmp_path):
    run_dir, _, history = scored_run
    first = evaluations(history)[0]
    theirs = lm_eval_cli(run_dir / f"checkpoint-{first['step']}", tmp_path / "lm_eval")
    assert first[METRIC] == pytest.approx(theirs["acc,none"], abs=1e-9)
    assert first[f"eval_{TASK}_acc_norm"] == pytest.approx(theirs["acc_norm,none"], abs=1e-9)
    assert first["eval_downstream_runtime"] > 0


def test_early_stopping_on_the_downstream_score_stops_where_the_logged_scores_say(scored_run):
    run_dir, stopped_at, history = scored_run
    scores = [(e["step"], e[METRIC]) for e in evaluations(history)]
    best, waited, expected = None, 0, MAX_STEPS  # EarlyStoppingCallback's rule, by hand: strictly better resets
    for step, score in scores:
        if best is None or score > best:
            best, waited = score, 0
        else:
            waited += 1
            if waited >= PATIENCE:
                expected = step
                break
    assert stopped_at == expected < MAX_STEPS
    losses = [e["eval_loss"] for e in evaluations(history)]
    assert losses[-1] < losses[-2]  # the loss still improved: the downstream score stopped the run
    state = json.loads((run_dir / "trainer_state.json").read_text())
    assert state["best_metric"] == max(score for _, score in scores)  # the best model is the best score's
    assert [s for s, _ in scores] == list(range(1, expected + 1))  # scored at every step until the stop


def test_samples_equal_plain_greedy_generation_from_the_checkpoint_and_reach_mlflow_wandb_tensorboard(scored_run):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run_dir, _, history = scored_run
    rows = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    step = evaluations(history)[0]["step"]
    at_step = {r["prompt"]: r["completion"] for r in rows if r["step"] == step}
    assert list(at_step) == PROMPTS
    checkpoint = run_dir / f"checkpoint-{step}"
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    for prompt in PROMPTS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)
        out = model.generate(**ids, do_sample=False, max_new_tokens=6, pad_token_id=tokenizer.pad_token_id)
        assert at_step[prompt] == tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)

    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{run_dir / 'mlruns' / 'mlflow.db'}")
    [experiment] = [e for e in client.search_experiments() if e.name != "Default"] or client.search_experiments()
    [run] = client.search_runs([experiment.experiment_id])
    copy = client.download_artifacts(run.info.run_id, "samples.jsonl", str(run_dir.parent / "dl"))
    assert Path(copy).read_text() == (run_dir / "samples.jsonl").read_text()

    tables = sorted(run_dir.glob("wandb/offline-run-*/files/media/table/eval/samples_*.table.json"))
    logged = [json.loads(t.read_text()) for t in tables]  # W&B's own table files, one per evaluation
    assert logged and all(t["columns"] == ["step", "prompt", "completion"] for t in logged)
    assert sorted(tuple(row) for t in logged for row in t["data"]) == sorted(
        (r["step"], r["prompt"], r["completion"]) for r in rows)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "runs" / "samples"), size_guidance={"tensors": 0}).Reload()
    texts = {e.step: e.tensor_proto.string_val[0].decode() for e in events.Tensors("eval/samples/text_summary")}
    assert all(at_step[p] in texts[step] for p in PROMPTS)  # the step's completions, as TensorBoard text


def test_task_mistakes_are_refused_at_load(tmp_path, tiny_llama_dir):
    raw = downstream_recipe(tiny_llama_dir, tmp_path, metric_for_best_model="eval_other_task_acc")
    with pytest.raises(HfTuneError, match="training.metric_for_best_model"):
        load_recipe(raw)
    raw = downstream_recipe(tiny_llama_dir, tmp_path)
    raw["evaluation"]["tasks"] = [str(tmp_path / "missing.yaml")]
    with pytest.raises(HfTuneError, match="evaluation.tasks.*does not exist"):
        load_recipe(raw)
    raw = downstream_recipe(tiny_llama_dir, tmp_path)
    raw["evaluation"]["task"] = [TASK]
    with pytest.raises(HfTuneError, match="did you mean 'tasks'"):
        load_recipe(raw)


def test_a_hub_task_is_refused_offline_naming_the_task_and_the_fix(tmp_path, tiny_llama_dir, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    task_file = tmp_path / "hub_task.yaml"  # a task over a Hub dataset nobody cached
    task_file.write_text("task: my_hub_task\ndataset_path: nobody/not-cached-dataset\noutput_type: multiple_choice\n"
                         "test_split: test\ndoc_to_text: q\ndoc_to_choice: ['a', 'b']\ndoc_to_target: 0\n")
    raw = downstream_recipe(tiny_llama_dir, tmp_path, metric_for_best_model="eval_my_hub_task_acc")
    raw["evaluation"]["tasks"] = [str(task_file)]
    with pytest.raises(HfTuneError, match="my_hub_task.*nobody/not-cached-dataset") as err:
        load_recipe(raw)
    assert "hf_tune_arithmetic" in str(err.value)  # the fix names the shipped offline task
    raw["evaluation"]["tasks"] = [TASK]  # the shipped task loads offline
    raw["training"]["metric_for_best_model"] = METRIC
    load_recipe(raw)


def test_an_optuna_study_on_a_downstream_score_records_it_per_trial_and_keeps_the_argmax(tmp_path, tiny_llama_dir):
    import yaml

    from hf_tune import search

    raw = chat_recipe(tiny_llama_dir, tmp_path / "study", max_steps=2, eval_strategy="steps", eval_steps=2,
                      save_strategy="steps", save_steps=2, learning_rate=1e-3, seed=0)
    raw["data"]["eval_split"] = 0.05
    raw["evaluation"] = {"tasks": [TASK], "limit": LIMIT, "batch_size": 4}
    raw["search"] = {"space": {"training.learning_rate": {"type": "categorical", "choices": [1e-4, 5e-2]}},
                     "metric": METRIC, "n_trials": 2, "sampler": "grid", "pruner": "none"}
    result = search(load_recipe(raw))

    trials = result["trials"]
    assert [t["state"] for t in trials] == ["COMPLETE", "COMPLETE"]
    for t in trials:  # the study's value is lm-eval's own score of the trial's saved model
        checkpoint = tmp_path / "study" / f"trial-{t['number']}" / "checkpoint-2"
        assert t["values"][0] == pytest.approx(lm_eval_in_process(checkpoint)["acc,none"], abs=1e-9)
    best = max(trials, key=lambda t: t["values"][0])
    assert result["best"][0]["values"][0] == best["values"][0]  # maximised: higher accuracy is better
    best_raw = yaml.safe_load(Path(result["best_recipe"]).read_text())
    assert best_raw["training"]["learning_rate"] == result["best"][0]["params"]["training.learning_rate"]


def test_hf_tune_eval_of_a_checkpoint_equals_the_in_process_score_and_refuses_incomplete_ones(scored_run):
    from hf_tune.workflows.evaluate import evaluate_run

    run_dir, _, history = scored_run
    first = evaluations(history)[0]
    [line] = evaluate_run(run_dir, checkpoint=first["step"], device="cpu", dtype="float32")
    assert line["step"] == first["step"] and line["scores"][METRIC] == first[METRIC]
    assert json.loads((run_dir / "eval_scores.jsonl").read_text().splitlines()[-1]) == line
    from hf_tune.search.compare import collect_runs, comparison_table

    table = comparison_table(collect_runs([run_dir]))  # hf-tune compare's table shows the watched score
    assert table[f"{METRIC} (checkpoint)"].iloc[0] == line["scores"][METRIC]
    (run_dir / "checkpoint-99").mkdir()  # no completeness marker
    with pytest.raises(HfTuneError, match="checkpoint-99: not a complete checkpoint"):
        evaluate_run(run_dir, checkpoint=99)


def test_hf_tune_eval_with_a_mistyped_task_stops_before_any_model_loads(scored_run, monkeypatch, capsys):
    import hf_tune.workflows.inference as chat
    from hf_tune.commands.cli import main

    run_dir, _, _ = scored_run
    monkeypatch.setattr(chat, "load_trained", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit) as stopped:
        main(["eval", str(run_dir), "--tasks", "hf_tune_arithmtic"])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and "Traceback" not in err, err
    assert "--tasks: 'hf_tune_arithmtic' is not an lm-eval task; did you mean 'hf_tune_arithmetic'?" in err, err


@pytest.mark.slow
def test_eval_watch_scores_each_checkpoint_of_a_run_in_progress_and_report_plots_them(tmp_path, tiny_llama_dir):
    from conftest import write_recipe

    run_dir = tmp_path / "run"
    raw = chat_recipe(tiny_llama_dir, run_dir, max_steps=3, save_strategy="steps", save_steps=1, learning_rate=3e-2,
                      seed=0)
    recipe = write_recipe(tmp_path / "recipe.yaml", raw)
    watcher = launch.start("hf-tune", "eval", str(run_dir), "--watch", "--tasks", TASK, "--limit", str(LIMIT),
                           "--batch-size", "4", "--interval", "0.5", "--device", "cpu")
    launch.run("python", "-m", "hf_tune.run", str(recipe), check=True, timeout=300)
    out, err = watcher.communicate(timeout=300)
    assert watcher.returncode == 0, err[-2000:]

    lines = [json.loads(line) for line in (run_dir / "eval_scores.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3]  # every checkpoint, once, in order
    assert [json.loads(line) for line in out.splitlines() if line.startswith("{")] == lines
    for line in (lines[0], lines[-1]):  # lm-eval's own score of the same checkpoint
        theirs = lm_eval_in_process(run_dir / line["checkpoint"])
        assert line["scores"][METRIC] == pytest.approx(theirs["acc,none"], abs=1e-9)

    from hf_tune.records.report import watched_scores, write_report

    assert [e[f"{METRIC} (checkpoint)"] for e in watched_scores(run_dir)] == [line["scores"][METRIC] for line in lines]
    assert run_dir / "eval_metrics.png" in write_report(run_dir)  # the run logs no eval metric of its own
