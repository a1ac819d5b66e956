#!/usr/bin/env bash
# Automatic recovery: torchrun restarts a worker that dies (up to 3 times); hf_tune resumes it from the newest
# complete checkpoint (training.resume_from_checkpoint: auto, the default).
#   bash examples/launch/elastic.sh recipes/llm_lora.yaml [overrides]
set -euo pipefail
recipe=${1:?usage: elastic.sh RECIPE [section.key=value ...]}
shift
exec torchrun --nproc_per_node "${NPROC:-1}" --max-restarts "${MAX_RESTARTS:-3}" -m hf_tune.run "$recipe" "$@"
