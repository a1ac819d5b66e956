#!/usr/bin/env bash
# Several machines. Run this on every node with the same MASTER_ADDR/MASTER_PORT and its own NODE_RANK.
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 NPROC=8 bash examples/launch/multi_node.sh recipes/llm_lora.yaml
set -euo pipefail
recipe=${1:?usage: multi_node.sh RECIPE [overrides]}; shift
: "${NNODES:?}" "${NODE_RANK:?}" "${MASTER_ADDR:?}"
MASTER_PORT=${MASTER_PORT:-29500}; NPROC=${NPROC:-8}
case "${LAUNCHER:-torchrun}" in
  torchrun)
    exec torchrun --nnodes "$NNODES" --node_rank "$NODE_RANK" --nproc_per_node "$NPROC" \
         --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" -m hf_tune.run "$recipe" "$@" ;;
  accelerate)
    exec accelerate launch --multi_gpu --num_machines "$NNODES" --machine_rank "$NODE_RANK" \
         --num_processes $((NNODES * NPROC)) --main_process_ip "$MASTER_ADDR" --main_process_port "$MASTER_PORT" \
         -m hf_tune.run "$recipe" "$@" ;;
  deepspeed)  # with ssh between nodes: run once, on the first node, with a hostfile ("host slots=8" per line)
    exec deepspeed --hostfile "${HOSTFILE:?}" --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" \
         --module hf_tune.run "$recipe" training.deepspeed="${DS:-zero3}" "$@" ;;
  deepspeed-no-ssh)  # clusters without ssh: run on every node with its NODE_RANK
    exec deepspeed --hostfile "${HOSTFILE:?}" --no_ssh --node_rank "$NODE_RANK" --master_addr "$MASTER_ADDR" \
         --master_port "$MASTER_PORT" --module hf_tune.run "$recipe" training.deepspeed="${DS:-zero3}" "$@" ;;
  *) echo "LAUNCHER must be torchrun, accelerate, deepspeed or deepspeed-no-ssh" >&2; exit 2 ;;
esac
