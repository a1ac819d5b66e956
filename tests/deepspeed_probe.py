"""Run under the `deepspeed` launcher by test_optim.py: train from a recipe, then dump the param groups that the
DeepSpeed engine's optimizer actually steps."""

import json
import sys

from hf_tune import build_datasets, build_model_and_tokenizer, build_trainer, build_training_arguments, load_recipe

recipe_path, report_path = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # the launcher adds it
recipe = load_recipe(recipe_path)
args = build_training_arguments(recipe)
model, tokenizer = build_model_and_tokenizer(recipe)
train_dataset, _ = build_datasets(recipe, tokenizer, args)
trainer = build_trainer(recipe, model, tokenizer, train_dataset, None, args)
trainer.train()
engine_optimizer = trainer.model_wrapped.optimizer
stepped = getattr(engine_optimizer, "optimizer", engine_optimizer)  # the optimizer inside ZeRO's wrapper
report = {
    "deepspeed": trainer.is_deepspeed_enabled,
    "engine": type(trainer.model_wrapped).__name__,
    "wrapper": type(engine_optimizer).__name__,
    "groups": [{"initial_lr": g["initial_lr"], "weight_decay": g["weight_decay"],
                "numel": sum(p.numel() for p in g["params"])} for g in stepped.param_groups],
}
with open(report_path, "w") as f:
    json.dump(report, f)
