"""Classification: shipped metrics against a hand computation, early stopping, k-fold CV, the cls_llrd recipe."""

from __future__ import annotations

import collections
import json
import math

import numpy as np
import pytest
from conftest import DATA, REPO, chat_recipe

from hf_tune import load_recipe, train
from hf_tune.errors import HfTuneError
from hf_tune.evaluation.trainer_metrics import build_compute_metrics
from hf_tune.recipe.schema import EvaluationSection

MINILM = "embedded:all-MiniLM-L6-v2"


def classification_recipe(out, train_path=DATA / "topics_train.jsonl", **training) -> dict:
    return {
        "model": {"pretrained_model_name_or_path": MINILM, "task": "sequence_classification"},
        "data": {"format": "classification", "train": {"path": str(train_path)},
                 "eval": {"path": str(DATA / "topics_test.jsonl")}, "max_length": 48},
        "evaluation": {"metrics": ["accuracy", "f1"]},
        "training": {"output_dir": str(out), "per_device_train_batch_size": 16, "learning_rate": 1e-4,
                     "report_to": "none", "disable_tqdm": True, "save_strategy": "no", "seed": 0, **training},
    }


def macro_f1_by_hand(predicted, reference):
    scores = []
    for c in sorted(set(reference) | set(predicted)):
        tp = sum(p == c and r == c for p, r in zip(predicted, reference))
        fp = sum(p == c and r != c for p, r in zip(predicted, reference))
        fn = sum(p != c and r == c for p, r in zip(predicted, reference))
        scores.append(0.0 if tp == 0 else 2 * tp / (2 * tp + fp + fn))
    return sum(scores) / len(scores)


def test_shipped_metrics_work_offline_and_match_a_hand_computation():
    from transformers import EvalPrediction

    rng = np.random.default_rng(0)
    logits = rng.normal(size=(50, 3))
    labels = rng.integers(0, 3, size=50)
    result = build_compute_metrics(EvaluationSection(metrics=["accuracy", "f1"]))(EvalPrediction(logits, labels))
    predicted = logits.argmax(-1).tolist()
    assert result["accuracy"] == pytest.approx(sum(p == r for p, r in zip(predicted, labels.tolist())) / 50)
    assert result["f1"] == pytest.approx(macro_f1_by_hand(predicted, labels.tolist()))


def test_metric_and_early_stopping_mistakes_are_caught_at_load(tmp_path):
    raw = classification_recipe(tmp_path, metric_for_best_model="precision")
    with pytest.raises(HfTuneError, match="training.metric_for_best_model"):
        load_recipe(raw)
    raw = classification_recipe(tmp_path)
    raw["evaluation"]["early_stopping_patience"] = 2
    with pytest.raises(HfTuneError, match="evaluation.early_stopping_patience"):
        load_recipe(raw)
    raw["evaluation"]["metrics"] = ["bleu"]
    with pytest.raises(HfTuneError, match="evaluation.metrics: unknown metric 'bleu'"):
        load_recipe(raw)
    raw = classification_recipe(tmp_path)
    raw["data"]["format"] = "chat"
    with pytest.raises(HfTuneError, match="data.format"):
        load_recipe(raw)


def test_early_stopping_stops_when_the_metric_stops_improving(tmp_path):
    raw = classification_recipe(tmp_path / "run", learning_rate=1e-9, max_steps=40, eval_strategy="steps",
                                eval_steps=2, save_strategy="steps", save_steps=2, load_best_model_at_end=True,
                                metric_for_best_model="accuracy", greater_is_better=True)
    raw["evaluation"]["early_stopping_patience"] = 1
    trainer = train(load_recipe(raw))
    assert trainer.state.global_step == 4  # best at step 2, no gain at step 4 -> patience 1 is used up


def test_causal_lm_eval_reports_perplexity(tmp_path, tiny_llama_dir):
    raw = chat_recipe(tiny_llama_dir, tmp_path / "run", eval_strategy="steps", eval_steps=2)
    raw["data"]["eval_split"] = 0.05
    trainer = train(load_recipe(raw))
    evals = [e for e in trainer.state.log_history if "eval_loss" in e]
    assert evals and all(e["eval_perplexity"] == pytest.approx(math.exp(e["eval_loss"])) for e in evals)


@pytest.mark.slow
def test_cls_llrd_recipe_beats_the_majority_baseline(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    trainer = train(load_recipe("recipes/cls_llrd.yaml", [f"training.output_dir={tmp_path / 'cls'}",
                                                          "training.num_train_epochs=2", "training.disable_tqdm=true"]))
    labels = [json.loads(line)["label"] for line in (DATA / "topics_test.jsonl").read_text().splitlines()]
    majority = collections.Counter(labels).most_common(1)[0][1] / len(labels)
    metrics = json.loads((tmp_path / "cls" / "eval_results.json").read_text())
    assert metrics["eval_accuracy"] >= majority + 0.4, (metrics, majority)
    assert metrics["eval_f1"] >= 0.6
    config = json.loads((tmp_path / "cls" / "config.json").read_text())
    assert sorted(config["label2id"]) == sorted(set(labels))
    assert trainer.optimizer.param_groups[0]["lr"] < trainer.optimizer.param_groups[-1]["lr"]  # LLRD was in force


@pytest.mark.slow
def test_three_fold_cv_is_stratified_and_writes_mean_and_std(tmp_path):
    from hf_tune.search.folds import cross_validate

    rows = (DATA / "topics_train.jsonl").read_text().splitlines()[:60]
    small = tmp_path / "small.jsonl"
    small.write_text("\n".join(rows) + "\n")
    recipe = load_recipe(classification_recipe(tmp_path / "cv", train_path=small, num_train_epochs=1))
    result = cross_validate(recipe, folds=3)
    written = json.loads((tmp_path / "cv" / "cv_results.json").read_text())
    assert written["folds"] == 3 and len(written["per_fold"]) == 3
    assert sum(f["eval_examples"] for f in written["per_fold"]) == 60
    accuracies = [f["eval_accuracy"] for f in written["per_fold"]]
    assert written["summary"]["eval_accuracy"]["mean"] == pytest.approx(np.mean(accuracies))
    assert written["summary"]["eval_accuracy"]["std"] == pytest.approx(np.std(accuracies))
    counts = collections.Counter(json.loads(r)["label"] for r in rows)
    for fold in written["per_fold"]:  # stratified: each fold holds a third of every class, give or take one
        assert (tmp_path / "cv" / f"fold-{fold['fold']}" / "eval_results.json").is_file()
        for label, count in counts.items():
            assert math.floor(count / 3) <= fold["eval_label_counts"][label] <= math.ceil(count / 3), (label, fold)
    assert result["labels"] == sorted(counts)
