#!/usr/bin/env bash
# One machine, N processes (GPUs, or CPU processes with gloo). Pick one form; all run the same module.
#   NPROC=4 bash examples/launch/single_node.sh recipes/llm_lora.yaml [section.key=value ...]
set -euo pipefail
recipe=${1:?usage: single_node.sh RECIPE [overrides]}; shift
NPROC=${NPROC:-2}
case "${LAUNCHER:-torchrun}" in
  torchrun)   exec torchrun --nproc_per_node "$NPROC" -m hf_tune.run "$recipe" "$@" ;;
  accelerate) exec accelerate launch --multi_gpu --num_processes "$NPROC" -m hf_tune.run "$recipe" "$@" ;;
  accelerate-deepspeed)  # the DeepSpeed JSON given to accelerate; keep training.deepspeed unset then
              exec accelerate launch --use_deepspeed --deepspeed_config_file "${DS_CONFIG:-ds_configs/zero3.json}" \
                   --num_processes "$NPROC" -m hf_tune.run "$recipe" "$@" ;;
  deepspeed)  exec deepspeed --num_gpus "$NPROC" --module hf_tune.run "$recipe" training.deepspeed="${DS:-zero3}" "$@" ;;
  *) echo "LAUNCHER must be torchrun, accelerate, accelerate-deepspeed or deepspeed" >&2; exit 2 ;;
esac
