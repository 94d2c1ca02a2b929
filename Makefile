# Two commands on a fresh clone:  `make demo`  and  `make test`.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
export DAGSTER_HOME ?= $(CURDIR)/.dagster_home

.PHONY: install demo test ui validate clean

$(BIN)/campaign: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	@touch $@

install: $(BIN)/campaign

demo: install            ## build the demo models (cached), run the demo campaign end to end
	$(BIN)/campaign build-models
	$(BIN)/campaign run demo

test: install            ## run the test suite
	$(BIN)/python -m pytest tests

ui: install              ## the Dagster UI on the same campaigns and instance
	$(BIN)/dagster dev -w workspace.yaml

validate: install
	$(BIN)/campaign validate

clean:
	rm -rf artifacts .dagster_home
