#!/bin/bash
# The runs behind docs/compare.png: recipes/llm_lora.yaml (embedded SmolLM2, LoRA) at three learning rates, 12 steps
# each, then `hf-tune compare` over them. About 4 minutes on 2 CPU cores.
set -e
for lr in 1.0e-4 4.0e-4 1.6e-3; do
  python -m hf_tune.run recipes/llm_lora.yaml training.output_dir=runs/compare/lr$lr training.learning_rate=$lr \
    training.max_steps=12 training.logging_steps=1 training.eval_steps=4 training.save_strategy=no
done
cd runs/compare && hf-tune compare lr1.0e-4 lr4.0e-4 lr1.6e-3 --out compare.png
