# Every target installs what it needs first; `make demo` and `make test` work on a fresh machine.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# A CPU build of torch: an unpinned torch would pull several GB of CUDA wheels.
TORCH_SPEC ?= torch==2.13.0
export HYDRA_FULL_ERROR ?= 0
export TOKENIZERS_PARALLELISM ?= false

.PHONY: install demo test test-fast ui budget sft-tiny bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)  ## create .venv and install the project with its test tools

demo: $(STAMP)  ## the default CPU experiment: fresh-only vs replay (rho=1, L=1, c=1), evaluated, summarised
	$(PY) -m src.run -m buffer=none,age1 clip=tight tracking.sweep=demo
	$(PY) -m analysis.summary --sweep demo --latest 2

test: $(STAMP)  ## the whole test suite (what CI runs)
	$(PY) -m pytest -q

test-fast: $(STAMP)  ## unit tests only (skips the end-to-end runs)
	$(PY) -m pytest -q -m "not slow"

ui: $(STAMP)  ## MLflow UI on the project's embedded store
	$(PY) -m mlflow ui --backend-store-uri sqlite:///$(CURDIR)/mlruns.db --default-artifact-root $(CURDIR)/mlartifacts --port 5000

budget: $(STAMP)  ## planned fresh verifier evaluations for the paper's settings (no model loaded)
	$(PY) -m src.budget trainer=paper buffer=age2 --ratios 0,0.5,1,1.5,2

sft-tiny: $(STAMP)  ## rebuild the tiny policy's warm start (checkpoints/tiny-countdown)
	$(PY) -m src.policy.sft

bench: $(STAMP)  ## per-phase step time of the tiny policy
	$(PY) -m benchmarks.step_phases

clean:
	rm -rf outputs multirun .pytest_cache
