"""hf_tune: one YAML recipe -> Hugging Face ``TrainingArguments``, model, tokenizer, datasets -> ``Trainer``.

Notebook API, each step callable alone::

    recipe = load_recipe("recipes/llm_lora.yaml", ["training.max_steps=20"])
    model, tokenizer = build_model_and_tokenizer(recipe)
    train_ds, eval_ds = build_datasets(recipe, tokenizer)
    trainer = build_trainer(recipe, model, tokenizer, train_ds, eval_ds, build_training_arguments(recipe))
    trainer.train()            # or simply: train(recipe)
    search(load_recipe("recipes/llm_lora_search.yaml"))   # hyperparameter search from the recipe's search section
"""

from hf_tune.data import build_datasets
from hf_tune.errors import HfTuneError, RecipeError
from hf_tune.search import search
from hf_tune.modeling import build_model_and_tokenizer
from hf_tune.recipe import Recipe, load_recipe
from hf_tune.training import train
from hf_tune.trainer import HfTuneTrainer, build_trainer
from hf_tune.training_args import build_training_arguments

__version__ = "0.1.0"
__all__ = [
    "HfTuneError",
    "HfTuneTrainer",
    "Recipe",
    "RecipeError",
    "build_datasets",
    "build_model_and_tokenizer",
    "build_trainer",
    "build_training_arguments",
    "load_recipe",
    "search",
    "train",
]
