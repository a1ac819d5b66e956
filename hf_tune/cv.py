"""``hf-tune cv``: stratified, seeded k-fold cross-validation of a classification recipe."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from hf_tune import run_folder
from hf_tune.build import build_run
from hf_tune.data import TrainingData, data_seed, tokenize
from hf_tune.data.classification import label_names
from hf_tune.data.loading import load_source
from hf_tune.errors import RecipeError
from hf_tune.model import build_tokenizer
from hf_tune.recipe.schema import Recipe
from hf_tune.tracking import tracking_scope


def cross_validate(recipe: Recipe, folds: int) -> dict:
    """Train ``folds`` models, each evaluated on its held-out fold of data.train; write per-fold metrics and
    mean ± std to ``output_dir/cv_results.json`` (fold runs in ``output_dir/fold-K``)."""
    from sklearn.model_selection import StratifiedKFold

    if recipe.data.format != "classification":
        raise RecipeError("data.format", "cross-validation stratifies by label: it needs format 'classification'")
    if folds < 2:
        raise RecipeError("--folds", f"needs at least 2 folds, got {folds}")
    out = recipe.output_dir
    tokenizer = build_tokenizer(recipe)
    raw = load_source(recipe.data.train, "data.train", recipe.data.format)
    labels = label_names(raw)
    dataset = tokenize(recipe, tokenizer, raw, "data.train", labels)
    targets = np.asarray(dataset["labels"])
    splitter = StratifiedKFold(n_splits=folds, shuffle=True, random_state=data_seed(recipe))

    per_fold = []
    for k, (train_idx, eval_idx) in enumerate(splitter.split(np.zeros(len(targets)), targets)):
        fold = dataclasses.replace(recipe, training={**recipe.training, "output_dir": str(out / f"fold-{k}")})
        run = build_run(fold, data=TrainingData(dataset.select(train_idx), dataset.select(eval_idx), labels))
        with tracking_scope(fold, Path(run.args.output_dir), run.trainer):  # each fold its own tracker run
            run.trainer.train()
            metrics = run.trainer.evaluate()
        run.trainer.save_metrics("eval", metrics)
        counts = np.bincount(targets[eval_idx], minlength=len(labels))
        per_fold.append({"fold": k, "train_examples": len(train_idx), "eval_examples": len(eval_idx),
                         "eval_label_counts": dict(zip(labels, counts.tolist())), **metrics})
    trainer = run.trainer

    names = [key for key, value in per_fold[0].items() if key.startswith("eval_") and isinstance(value, float)
             and "runtime" not in key and "per_second" not in key]
    summary = {name: {"mean": float(np.mean([f[name] for f in per_fold])),
                      "std": float(np.std([f[name] for f in per_fold]))} for name in names}
    result = {"folds": folds, "seed": data_seed(recipe), "labels": labels, "per_fold": per_fold, "summary": summary}
    if trainer.is_world_process_zero():
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / run_folder.CV_RESULTS).write_text(json.dumps(result, indent=2))
    return result
