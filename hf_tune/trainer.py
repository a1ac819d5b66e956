"""HfTuneTrainer: the one ``transformers.Trainer`` subclass, extended only through Trainer's own hooks."""

from __future__ import annotations

from transformers import Trainer, TrainingArguments

from hf_tune.data import build_collator
from hf_tune.recipe.loading import Recipe


class HfTuneTrainer(Trainer):
    """``Trainer`` plus the recipe it was built from. Optimizer and schedule hooks (LLRD, warmup-cosine with a floor)
    are added here through ``create_optimizer`` / ``create_scheduler``."""

    def __init__(self, *args, recipe: Recipe | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.recipe = recipe


def build_trainer(recipe: Recipe, model, tokenizer, train_dataset, eval_dataset, args: TrainingArguments) -> HfTuneTrainer:
    return HfTuneTrainer(
        model=model,
        args=args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        data_collator=build_collator(tokenizer),
        recipe=recipe,
    )
