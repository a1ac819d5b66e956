"""Cross-validated search (search.cv: k) with Optuna's WilcoxonPruner: real Optuna studies over real Trainer runs of
a tiny random BERT classifier, checked against a hand-computed Wilcoxon signed-rank rule."""

from __future__ import annotations

import itertools
import json
import warnings
from pathlib import Path

import launch
import numpy as np
import optuna
import pytest
import yaml
from conftest import DATA, write_recipe

from hf_tune import load_recipe, search
from hf_tune.errors import HfTuneError

MINILM = "embedded:all-MiniLM-L6-v2"
GOOD, BAD = 1e-2, 1e-9  # learning rates: a tiny BERT learns the topics in a few steps at 1e-2, not at all at 1e-9


@pytest.fixture(scope="session")
def tiny_bert_dir(tmp_path_factory) -> str:
    """A randomly initialised 1-layer BERT with MiniLM's tokenizer: a classifier that trains in a second."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    from hf_tune.model.embedded import embedded_model_path

    tokenizer = AutoTokenizer.from_pretrained(embedded_model_path(MINILM))
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=2, max_position_embeddings=64, num_labels=4)
    folder = tmp_path_factory.mktemp("tiny-bert")
    BertForSequenceClassification(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="session")
def topics_80(tmp_path_factory) -> Path:
    """The first 80 rows of the topics data (four classes, 18 to 23 rows each)."""
    path = tmp_path_factory.mktemp("topics") / "topics_80.jsonl"
    path.write_text("\n".join((DATA / "topics_train.jsonl").read_text().splitlines()[:80]) + "\n")
    return path


def cv_recipe(model_dir: str, train: Path, out: Path, search_section: dict, **training) -> dict:
    return {
        "model": {"pretrained_model_name_or_path": model_dir, "task": "sequence_classification"},
        "data": {"format": "classification", "train": {"path": str(train)}, "max_length": 32},
        "training": {"output_dir": str(out), "max_steps": 20, "per_device_train_batch_size": 16,
                     "learning_rate": GOOD, "report_to": "none", "save_strategy": "no", "disable_tqdm": True,
                     "seed": 0, **training},
        "search": {"n_trials": 4, **search_section},
    }


def signed_rank_p(diffs: list[float]) -> float:
    """One-sided exact Wilcoxon signed-rank p-value that the differences are positive, by enumerating every sign
    assignment of the ranks of |d| (no zeros or ties here: float losses)."""
    ranks = np.argsort(np.argsort(np.abs(diffs))) + 1
    observed = ranks[np.asarray(diffs) > 0].sum()
    sums = [sum(r for r, s in zip(ranks, signs) if s) for signs in itertools.product((0, 1), repeat=len(diffs))]
    return float(np.mean([s >= observed for s in sums]))


def wilcoxon_would_prune(values: dict[int, float], best: dict[int, float], p_threshold: float) -> bool:
    """WilcoxonPruner's rule for a minimised metric, restated: pair the trial's folds with the best trial's same
    folds; prune when there are at least two pairs, the one-sided p-value that the trial is worse is below the
    threshold, and the trial's mean so far is worse than the best trial's mean over all its folds."""
    diffs = [values[k] - best[k] for k in values if k in best]
    if len(diffs) < 2:
        return False
    worse_on_average = np.mean(list(values.values())) > np.mean(list(best.values()))
    return signed_rank_p(diffs) < p_threshold and worse_on_average


def test_signed_rank_p_by_hand_agrees_with_scipy():
    from scipy.stats import wilcoxon

    rng = np.random.default_rng(0)
    for n in (2, 3, 4, 5):
        diffs = rng.normal(0.3, 1.0, size=n).tolist()
        assert signed_rank_p(diffs) == pytest.approx(
            wilcoxon(diffs, alternative="greater", zero_method="zsplit").pvalue)


@pytest.mark.slow  # 14 fold runs: 15 s on an idle 2-core CPU, up to 50 s beside other runs
def test_wilcoxon_prunes_bad_learning_rates_after_a_few_folds(tmp_path, tiny_bert_dir, topics_80):
    k, p_threshold = 4, 0.2  # with 4 folds the smallest one-sided p-value of 3 pairs is 1/8: prunable after 3
    space = {"training.learning_rate": {"type": "categorical", "choices": [GOOD, BAD, 2 * BAD, 3 * BAD]}}
    raw = cv_recipe(tiny_bert_dir, topics_80, tmp_path / "study", {
        "space": space, "sampler": "grid", "cv": k, "pruner_kwargs": {"p_threshold": p_threshold}})
    recipe = load_recipe(write_recipe(tmp_path / "cv_search.yaml", raw))
    assert recipe.search.pruner == "wilcoxon"  # the default with cv
    result = search(recipe)

    study = optuna.load_study(study_name="cv_search", storage=f"sqlite:///{tmp_path / 'study' / 'study.db'}")
    trials = sorted(study.trials, key=lambda t: t.number)
    assert [t.state.name for t in trials].count("COMPLETE") >= 1
    assert "PRUNED" in [t.state.name for t in trials], [(t.params, t.state.name) for t in trials]
    completed: list = []  # the trials completed so far, in the order they ran (one worker: by number)
    for t in trials:
        folds = {int(f): v for f, v in t.user_attrs["fold_values"].items()}
        order = t.user_attrs["fold_order"]
        assert sorted(order) == list(range(k))
        assert list(folds) == order[:len(folds)]  # trained in its own order, step = fold id
        assert t.intermediate_values == folds
        assert t.value == pytest.approx(np.mean(list(folds.values())))  # the mean over the folds it ran
        best = min(completed, key=lambda c: c.value) if completed else None
        best_folds = {int(f): v for f, v in best.user_attrs["fold_values"].items()} if best else {}
        prefixes = [{f: folds[f] for f in order[:n]} for n in range(1, len(folds) + 1)]
        # not prunable after any fold before the one it stopped at (or before its last fold)
        for prefix in prefixes[:-1]:
            assert not wilcoxon_would_prune(prefix, best_folds, p_threshold), (t.number, prefix)
        if t.state.name == "PRUNED":
            assert len(folds) < k
            assert wilcoxon_would_prune(folds, best_folds, p_threshold), (t.number, folds, best_folds)
        else:
            assert t.state.name == "COMPLETE" and len(folds) == k  # completed trials ran every fold
            completed.append(t)
    bad = [t for t in trials if t.params["training.learning_rate"] < 1e-6]
    good = [t for t in trials if t.params["training.learning_rate"] == GOOD]
    assert good[0].state.name == "COMPLETE" and result["best"][0]["number"] == good[0].number
    assert all(t.state.name == "PRUNED" for t in bad if t.number > good[0].number)  # bad after good stop early

    by_number = {t["number"]: t for t in result["trials"]}  # the summary shows which folds ran
    for t in trials:
        assert by_number[t.number]["fold_values"] == {int(f): v for f, v in t.user_attrs["fold_values"].items()}
    for name in ("best_recipe.yaml", "trials.csv", "optimization_history.png"):
        assert (tmp_path / "study" / name).is_file(), name
    best_raw = yaml.safe_load(Path(result["best_recipe"]).read_text())
    assert "search" not in best_raw and best_raw["training"]["learning_rate"] == GOOD
    first = trials[0]
    for fold in first.user_attrs["fold_values"]:
        assert (tmp_path / "study" / f"trial-{first.number}" / f"fold-{fold}" / "eval_results.json").is_file()

    # the Terminator's noise under cv: the scaled spread of the best trial's fold scores (CrossValidationErrorEvaluator)
    from hf_tune.search.sampling import make_terminator

    best = study.best_trial
    scores = [best.user_attrs["fold_values"][str(f)] for f in best.user_attrs["fold_order"]]
    assert best.system_attrs["terminator:cv_scores"] == pytest.approx(scores)
    recipe.search.terminator = "regret_bound"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        noise = make_terminator(recipe.search, cross_validated=True)._error_evaluator.evaluate(
            study.trials, study.direction)
    assert noise == pytest.approx(np.sqrt((1 / k + 1 / (k - 1)) * np.var(scores)))


def test_every_trial_gets_the_same_seeded_stratified_folds(tiny_bert_dir, topics_80, tmp_path):
    from sklearn.model_selection import StratifiedKFold

    from hf_tune.search.cross_validated import fold_order
    from hf_tune.search.folds import kfold_splits

    recipe = load_recipe(cv_recipe(tiny_bert_dir, topics_80, tmp_path, {
        "space": {"training.learning_rate": {"type": "float", "low": 1e-4, "high": 1e-2}}, "cv": 4}))
    labels = [json.loads(line)["label"] for line in topics_80.read_text().splitlines()]
    expected = StratifiedKFold(4, shuffle=True, random_state=0).split(np.zeros(80), labels)  # training.seed 0
    folds, again = kfold_splits(recipe, 4), kfold_splits(recipe, 4)
    for (train, held_out), (e_train, e_held_out), (_, a_held_out) in zip(folds.splits, expected, again.splits):
        assert held_out.tolist() == e_held_out.tolist() == a_held_out.tolist()
        assert train.tolist() == e_train.tolist()
    orders = [fold_order(recipe.search, n) for n in range(6)]
    assert all(sorted(o) == [0, 1, 2, 3] for o in orders) and len({tuple(o) for o in orders}) > 1
    assert fold_order(recipe.search, 3) == orders[3]  # seeded: search.seed + the trial number


def test_without_pruning_every_trial_runs_every_fold_and_several_metrics_are_means(tmp_path, tiny_bert_dir,
                                                                                   topics_80):
    space = {"training.learning_rate": {"type": "categorical", "choices": [GOOD, -1.0]}}  # -1 fails its trial
    raw = cv_recipe(tiny_bert_dir, topics_80, tmp_path / "study", {
        "space": space, "sampler": "grid", "cv": 2, "pruner": "none", "n_trials": 2,
        "metric": ["eval_loss", "trainable_params"]}, max_steps=2)
    result = search(load_recipe(raw))
    by_lr = {t["params"]["training.learning_rate"]: t for t in result["trials"]}
    assert by_lr[-1.0]["state"] == "FAIL" and "learning_rate" in by_lr[-1.0]["error"]
    good = by_lr[GOOD]
    assert good["state"] == "COMPLETE" and sorted(good["fold_values"]) == [0, 1]
    losses = [v[0] for v in good["fold_values"].values()]
    assert good["values"][0] == pytest.approx(np.mean(losses))
    assert good["values"][1] == good["trainable_params"]


@pytest.mark.parametrize("search_keys, data_format, key, message", [
    ({"pruner": "wilcoxon"}, "classification", "search.pruner", "needs a cross-validated search"),
    ({"cv": 3, "pruner": "median"}, "classification", "search.pruner", "set search.pruner: wilcoxon"),
    ({"cv": 3, "pruner": "hyperband"}, "classification", "search.pruner", "one value per fold"),
    ({"cv": 3, "backend": "ray"}, "classification", "search.cv", "runs on the Optuna backend"),
    ({"cv": 3}, "chat", "search.cv", "stratified by label"),
    ({"cv": 1}, "classification", "search.cv", "greater than or equal to 2"),
    ({"cv": 3, "metric": ["eval_loss", "trainable_params"]}, "classification", "search.pruner",
     "cannot prune multi-objective"),
])
def test_bad_cross_validated_searches_are_refused_at_load(tmp_path, tiny_bert_dir, topics_80, tiny_llama_dir,
                                                          search_keys, data_format, key, message):
    raw = cv_recipe(tiny_bert_dir, topics_80, tmp_path, {
        "space": {"training.learning_rate": {"type": "float", "low": 1e-4, "high": 1e-2}}, **search_keys})
    if data_format == "chat":
        raw["model"] = {"pretrained_model_name_or_path": tiny_llama_dir}
        raw["data"] = {"format": "chat", "train": {"path": str(DATA / "chat_demo.jsonl")}, "max_length": 64}
    with pytest.raises(HfTuneError, match=key) as raised:
        load_recipe(raw)
    assert message in str(raised.value)


def test_a_bad_wilcoxon_argument_names_pruner_kwargs(tiny_bert_dir, topics_80, tmp_path):
    from hf_tune.search.sampling import make_pruner

    recipe = load_recipe(cv_recipe(tiny_bert_dir, topics_80, tmp_path, {
        "space": {"training.learning_rate": {"type": "float", "low": 1e-4, "high": 1e-2}}, "cv": 3,
        "pruner_kwargs": {"p_threshold": 2.0}}))
    with pytest.raises(HfTuneError, match="search.pruner_kwargs: p_threshold must be between 0 and 1"):
        make_pruner(recipe.search)


@pytest.mark.slow
def test_a_killed_cross_validated_trial_keeps_its_folds_and_resumes_the_one_it_was_in(tmp_path, tiny_bert_dir,
                                                                                     topics_80):
    """SIGKILL the study once a fold has finished and another has a complete checkpoint. Rerunning the command
    resumes the same trial: the finished fold is kept, not trained again, the interrupted one is trained on from
    its last complete checkpoint, and every fold's value, and so the trial's, equals an uninterrupted study's."""
    import signal
    import subprocess
    import time

    from hf_tune.trainer.checkpoints import is_complete

    def study_recipe(name: str) -> Path:
        raw = cv_recipe(tiny_bert_dir, topics_80, tmp_path / name, {
            "space": {"training.learning_rate": {"type": "categorical", "choices": [GOOD]}}, "sampler": "grid",
            "cv": 3, "pruner": "none", "n_trials": 1}, max_steps=60, save_strategy="steps", save_steps=5)
        return write_recipe(tmp_path / f"{name}.yaml", raw)

    def trial_0(name: str):
        return optuna.load_study(study_name=name, storage=f"sqlite:///{tmp_path / name / 'study.db'}").trials[0]

    search(load_recipe(study_recipe("whole")))
    command = ["python", "-m", "hf_tune.commands.cli", "search", str(study_recipe("killed"))]
    folds = [tmp_path / "killed" / "trial-0" / f"fold-{k}" for k in range(3)]

    def finished(fold: Path) -> bool:
        return (fold / "eval_results.json").is_file()

    proc = launch.start(*command, stdout=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not (any(finished(f) for f in folds) and any(not finished(f) and any(
            is_complete(c) for c in f.glob("checkpoint-*")) for f in folds)):
        assert proc.poll() is None, f"the study ended before the kill: {proc.stderr.read()[-2000:]}"
        assert time.time() < deadline, "timed out waiting"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done_before = {k for k, f in enumerate(folds) if finished(f)}
    first_results = {k: (folds[k] / "eval_results.json").read_text() for k in done_before}
    assert trial_0("killed").state == optuna.trial.TrialState.RUNNING

    result = launch.run(*command)
    assert result.returncode == 0, result.stderr[-3000:]
    killed, whole = trial_0("killed"), trial_0("whole")
    assert killed.state == optuna.trial.TrialState.COMPLETE and killed.user_attrs["resumed"] is True
    assert killed.number == 0 and killed.params == whole.params
    assert all((folds[k] / "eval_results.json").read_text() == first_results[k] for k in done_before)  # kept
    assert killed.user_attrs["fold_values"] == whole.user_attrs["fold_values"]
    assert killed.value == whole.value
    assert len(optuna.load_study(study_name="killed", storage=f"sqlite:///{tmp_path / 'killed' / 'study.db'}")
               .trials) == 1
