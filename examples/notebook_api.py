"""The notebook API step by step: the same calls `python -m hf_tune.run` makes, each one usable alone.

    python examples/notebook_api.py                       # a short LoRA run of the embedded SmolLM2
    python examples/notebook_api.py training.max_steps=2  # any recipe override
"""

import sys

from hf_tune import build_datasets, build_model_and_tokenizer, build_trainer, build_training_arguments, load_recipe
from hf_tune.workflows.inference import reply

recipe = load_recipe("recipes/llm_lora.yaml", ["training.max_steps=10", "training.output_dir=runs/notebook_api",
                                               "training.eval_strategy=no", "data.eval_split=null", *sys.argv[1:]])
args = build_training_arguments(recipe)
model, tokenizer = build_model_and_tokenizer(recipe)
model.print_trainable_parameters()

train_dataset, eval_dataset = build_datasets(recipe, tokenizer)
first = train_dataset[0]["labels"]  # with data.batch_tokens a row is a pack: a list of examples
first = first[0] if first and isinstance(first[0], list) else first
print("first example, trained part:", repr(tokenizer.decode([t for t in first if t != -100])))

trainer = build_trainer(recipe, model, tokenizer, train_dataset, eval_dataset, args)
trainer.train()
trainer.save_model()

answer = reply(model, tokenizer, [{"role": "user", "content": "What is the capital of Japan?"}], max_new_tokens=24)
print("model says:", answer)
