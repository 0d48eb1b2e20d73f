# Two commands: `make demo` (the main job) and `make test`. Each builds .venv from
# nothing when it is missing. CUDA users: make test TORCH_SPEC='torch==2.13.0 --index-url ...'
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0

.PHONY: demo test lint clean chromium

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.torch: | $(BIN)/python
	$(BIN)/pip install -q $(TORCH_SPEC)
	touch $@

$(VENV)/.demo: pyproject.toml $(VENV)/.torch
	$(BIN)/pip install -q -e '.[viz,train]'
	touch $@

# the released d2l package's wheel is read by tests/test_d2l_release.py (never installed:
# it pins an old torch stack); pip only downloads it
$(VENV)/.test: pyproject.toml $(VENV)/.torch
	$(BIN)/pip install -q -e '.[viz,train,dev,keras,hf,pretrained,browser,notebook,onnx]'
	$(BIN)/pip download -q --no-deps d2l==1.0.3 -d $(VENV)/wheels
	touch $@

# the explorer's browser tests drive Debian's Chromium (never a browser download);
# installed when missing and we are root (CI), skipped cleanly elsewhere
chromium:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) ; } || \
	  echo "chromium not installed: the browser tests will skip"

demo: $(VENV)/.demo
	$(BIN)/multihead demo

lint: $(VENV)/.test
	$(BIN)/ruff check src tests $(wildcard bench)

test: $(VENV)/.test chromium lint
	KERAS_BACKEND=torch HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV)
