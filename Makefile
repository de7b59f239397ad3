# genqueue: `make run` starts the stack, `make test` runs the tests, `make bench` measures.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test bench bench-quick model clean

$(STAMP): requirements.txt requirements-dev.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -r requirements-dev.txt
	touch $(STAMP)

model: $(STAMP)
	$(BIN)/python -m worker.devmodels --shape tiny --out .models/tiny-opt

run: model
	$(BIN)/python -m scripts.stack

test: model
	$(BIN)/python -m pytest

bench: $(STAMP)
	$(BIN)/python -m bench.run

clean:
	rm -rf $(VENV) .models .pytest_cache
