#!/usr/bin/env bash
# The recipes in this folder, as `hf-tune init` writes them (run from the repository root, offline is fine).
set -euo pipefail
init() { HF_HUB_OFFLINE=1 hf-tune init "$@" --data examples/data/chat_demo.jsonl; }
init meta-llama/Llama-3.1-8B-Instruct --gpus 1 --gpu-memory 24 --out recipes/scale/llama-3.1-8b-1x24gb.yaml
init meta-llama/Llama-3.1-8B-Instruct --gpus 1 --gpu-memory 80 --out recipes/scale/llama-3.1-8b-1x80gb.yaml
init meta-llama/Llama-3.1-8B-Instruct --gpus 8 --gpu-memory 80 --tuning full --out recipes/scale/llama-3.1-8b-full-8x80gb.yaml
init Qwen/Qwen2.5-7B-Instruct --gpus 1 --gpu-memory 24 --out recipes/scale/qwen2.5-7b-1x24gb.yaml
init Qwen/Qwen3-8B --gpus 1 --gpu-memory 80 --out recipes/scale/qwen3-8b-1x80gb.yaml
init mistralai/Mistral-7B-Instruct-v0.3 --gpus 8 --gpu-memory 80 --out recipes/scale/mistral-7b-8x80gb.yaml
init google/gemma-3-1b-it --gpus 1 --gpu-memory 24 --out recipes/scale/gemma-3-1b-1x24gb.yaml
init meta-llama/Llama-3.1-70B-Instruct --gpus 8 --gpu-memory 80 --tuning qlora --setup zero3 --out recipes/scale/llama-3.1-70b-qlora-8x80gb.yaml
init meta-llama/Llama-3.1-70B-Instruct --gpus 8 --gpu-memory 80 --out recipes/scale/llama-3.1-70b-lora-8x80gb.yaml
init meta-llama/Llama-3.1-70B-Instruct --gpus 1 --gpu-memory 80 --out recipes/scale/llama-3.1-70b-qlora-1x80gb.yaml
init Qwen/Qwen2.5-72B-Instruct --gpus 8 --gpu-memory 80 --tuning qlora --setup zero3 --out recipes/scale/qwen2.5-72b-qlora-8x80gb.yaml
# llama-3.1-70b-qlora-fsdp-8x80gb.yaml is llama-3.1-70b-qlora-8x80gb.yaml with training.deepspeed replaced by
# FSDP2 keys (fsdp, fsdp_config with activation_checkpointing), by hand.
# mixtures of experts: LoRA on attention and the fused experts where it fits, attention only where it does not
init Qwen/Qwen3-30B-A3B --gpus 1 --gpu-memory 80 --out recipes/scale/qwen3-30b-a3b-1x80gb.yaml
init Qwen/Qwen3-30B-A3B --gpus 8 --gpu-memory 80 --out recipes/scale/qwen3-30b-a3b-8x80gb.yaml
init openai/gpt-oss-20b --gpus 1 --gpu-memory 80 --out recipes/scale/gpt-oss-20b-1x80gb.yaml
init mistralai/Mixtral-8x7B-Instruct-v0.1 --gpus 8 --gpu-memory 80 --setup zero3 --out recipes/scale/mixtral-8x7b-zero3-8x80gb.yaml
