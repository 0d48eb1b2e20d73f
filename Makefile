# Two commands: `make demo` (the main job) and `make test`. Each builds .venv from
# nothing when it is missing. CUDA users: make test TORCH_SPEC='torch==2.13.0 --index-url ...'
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0

.PHONY: demo test lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.torch: | $(BIN)/python
	$(BIN)/pip install -q $(TORCH_SPEC)
	touch $@

$(VENV)/.demo: pyproject.toml $(VENV)/.torch
	$(BIN)/pip install -q -e '.[viz]'
	touch $@

$(VENV)/.test: pyproject.toml $(VENV)/.torch
	$(BIN)/pip install -q -e '.[viz,dev,keras,hf,pretrained]'
	touch $@

demo: $(VENV)/.demo
	$(BIN)/multihead demo

lint: $(VENV)/.test
	$(BIN)/ruff check src tests $(wildcard bench)

test: $(VENV)/.test lint
	KERAS_BACKEND=torch HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV)
