"""``hf-tune cv``: stratified, seeded k-fold cross-validation of a classification recipe. The folds (``kfold_splits``)
and the training of one fold (``train_fold``) are shared with a cross-validated search (``search.cv``)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from hf_tune import run_folder
from hf_tune.assembly.run_build import build_run
from hf_tune.catalog.formats import format_names, format_of
from hf_tune.data import TrainingData, data_seed, tokenize
from hf_tune.data.classification import label_names
from hf_tune.data.loading import load_source
from hf_tune.errors import RecipeError
from hf_tune.model import build_tokenizer
from hf_tune.recipe.schema import Recipe
from hf_tune.records.tracking import tracking_scope


@dataclasses.dataclass
class Folds:
    """data.train tokenized once, its class names, and the k (train, held-out) index splits of a seeded
    StratifiedKFold: the same folds for every caller with the same recipe seed."""

    dataset: object  # datasets.Dataset
    labels: list[str]
    splits: list[tuple[np.ndarray, np.ndarray]]
    seed: int

    def data(self, k: int) -> TrainingData:
        """Fold ``k``: train on the other folds, evaluate on fold k."""
        train_idx, eval_idx = self.splits[k]
        return TrainingData(self.dataset.select(train_idx), self.dataset.select(eval_idx), self.labels)


def kfold_splits(recipe: Recipe, folds: int, key: str = "--folds") -> Folds:
    """Stratified k folds of data.train, shuffled with the recipe's data seed (``training.data_seed``, else
    ``training.seed``). ``key``: the setting that asked for ``folds`` (named in errors)."""
    from sklearn.model_selection import StratifiedKFold

    if not format_of(recipe.data.format).class_labels:
        labelled = " or ".join(repr(name) for name in format_names(class_labels=True))
        raise RecipeError("data.format", f"cross-validation stratifies by label: it needs format {labelled}")
    if folds < 2:
        raise RecipeError(key, f"needs at least 2 folds, got {folds}")
    tokenizer = build_tokenizer(recipe)
    raw = load_source(recipe.data.train, "data.train", recipe.data.format)
    labels = label_names(raw)
    dataset = tokenize(recipe, tokenizer, raw, "data.train", labels)
    targets = np.asarray(dataset["labels"])
    seed = data_seed(recipe)
    splitter = StratifiedKFold(n_splits=folds, shuffle=True, random_state=seed)
    splits = list(splitter.split(np.zeros(len(targets)), targets))
    return Folds(dataset, labels, splits, seed)


def train_fold(recipe: Recipe, folds: Folds, k: int, output_dir: Path, resume: str | None = None):
    """Train ``recipe`` on every fold but ``k`` into ``output_dir`` (from checkpoint ``resume`` when given) and
    evaluate on fold k (its own tracker run); returns the trainer and its evaluation metrics."""
    # each fold its own folder; resilience.checkpoint_mirror names one place, so folds are not mirrored
    fold = dataclasses.replace(recipe, training={**recipe.training, "output_dir": str(output_dir)},
                               resilience=recipe.resilience.model_copy(update={"checkpoint_mirror": None}))
    run = build_run(fold, data=folds.data(k))
    with tracking_scope(fold, Path(run.args.output_dir), run.trainer):  # each fold its own tracker run
        run.trainer.train(resume_from_checkpoint=resume)
        metrics = run.trainer.evaluate()
    run.trainer.save_metrics("eval", metrics)
    return run.trainer, metrics


def cross_validate(recipe: Recipe, folds: int) -> dict:
    """Train ``folds`` models, each evaluated on its held-out fold of data.train; write per-fold metrics and
    mean ± std to ``output_dir/cv_results.json`` (fold runs in ``output_dir/fold-K``)."""
    out = recipe.output_dir
    split = kfold_splits(recipe, folds)
    targets = np.asarray(split.dataset["labels"])
    per_fold = []
    for k, (train_idx, eval_idx) in enumerate(split.splits):
        trainer, metrics = train_fold(recipe, split, k, out / f"fold-{k}")
        counts = np.bincount(targets[eval_idx], minlength=len(split.labels))
        per_fold.append({"fold": k, "train_examples": len(train_idx), "eval_examples": len(eval_idx),
                         "eval_label_counts": dict(zip(split.labels, counts.tolist())), **metrics})

    names = [key for key, value in per_fold[0].items() if key.startswith("eval_") and isinstance(value, float)
             and "runtime" not in key and "per_second" not in key]
    summary = {name: {"mean": float(np.mean([f[name] for f in per_fold])),
                      "std": float(np.std([f[name] for f in per_fold]))} for name in names}
    result = {"folds": folds, "seed": split.seed, "labels": split.labels, "per_fold": per_fold, "summary": summary}
    if trainer.is_world_process_zero():
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / run_folder.CV_RESULTS).write_text(json.dumps(result, indent=2))
    return result
