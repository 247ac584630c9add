# Everything runs in a local virtualenv with the CPU build of torch.
# (A loose `pip install torch` can pull a multi-GB CUDA build; pyproject.toml states the
# range the code supports, this pin picks the CPU wheel for CI and laptops.)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0
# test extras: triton lets the kernel tests run in Triton's CPU interpreter (about 1 GB installed),
# hf brings transformers for attnres.hf, eval the lm-evaluation-harness that tests/hf/test_harness.py
# drives; `make test TEST_EXTRAS=dev` skips those tests
TEST_EXTRAS ?= dev,hf,triton,eval

.PHONY: install test demo clean

$(BIN)/.installed: pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e .
	touch $@

$(BIN)/.installed-test: $(BIN)/.installed
	$(BIN)/python -m pip install -q -e '.[$(TEST_EXTRAS)]'
	touch $@

install: $(BIN)/.installed

# one pytest-xdist worker per core (TEST_WORKERS=0: one process, as a plain `pytest` runs)
TEST_WORKERS ?= $(shell nproc 2>/dev/null || echo 2)

test: $(BIN)/.installed-test
	$(BIN)/python -m pytest -n $(TEST_WORKERS)

demo: install
	$(BIN)/attnres demo

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
