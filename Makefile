# Everything runs in a local virtualenv with the CPU build of torch.
# (A loose `pip install torch` can pull a multi-GB CUDA build; pyproject.toml states the
# range the code supports, this pin picks the CPU wheel for CI and laptops.)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0
# test extras: triton lets the kernel tests run in Triton's CPU interpreter (about 1 GB installed),
# hf brings transformers for attnres.hf, eval the lm-evaluation-harness that tests/hf/test_harness.py
# drives; torchtitan the dependencies of attnres.integrations.torchtitan (torchtitan itself comes with
# --no-deps, below); `make test TEST_EXTRAS=dev` skips those tests
TEST_EXTRAS ?= dev,hf,triton,eval,serving,torchtitan
# installed without its dependencies when TEST_EXTRAS has torchtitan (pyproject.toml's torchtitan extra says why);
# torchtitan needs Python 3.11+, so older interpreters skip it (and its tests skip)
TORCHTITAN ?= torchtitan==0.3.0
# what `make install` adds to the core: the extras the README's tour uses (transformers for the Hugging Face
# and Kimi Linear stops, gguf for --to gguf); `make install EXTRAS=` installs the core alone
EXTRAS ?= hf,serving

.PHONY: install test test-fast test-hf-lowest lint demo clean test-serving

$(BIN)/.installed: pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e .
	touch $@

$(BIN)/.installed-test: $(BIN)/.installed
	$(BIN)/python -m pip install -q -e '.[$(TEST_EXTRAS)]'
	case ',$(TEST_EXTRAS),' in *,torchtitan,*) if $(BIN)/python -c 'import sys; sys.exit(sys.version_info < (3, 11))'; \
		then $(BIN)/python -m pip install -q --no-deps '$(TORCHTITAN)'; fi;; esac
	touch $@

$(BIN)/.installed-extras: $(BIN)/.installed
	$(if $(EXTRAS),$(BIN)/python -m pip install -q -e '.[$(EXTRAS)]')
	touch $@

# then `source .venv/bin/activate` puts `attnres` on PATH (or call .venv/bin/attnres)
install: $(BIN)/.installed-extras

# one pytest-xdist worker per core (TEST_WORKERS=0: one process, as a plain `pytest` runs)
TEST_WORKERS ?= $(shell nproc 2>/dev/null || echo 2)

test: $(BIN)/.installed-test
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --durations=15

# the retrofit round trips and the HF model class on the lowest transformers pyproject.toml allows (make test
# runs the newest): that version goes into build/ beside the installed one, and PYTHONPATH puts it first
TRANSFORMERS_LOWEST ?= transformers==5.24.0
test-hf-lowest: $(BIN)/.installed-test
	test -d build/$(TRANSFORMERS_LOWEST) || $(BIN)/python -m pip install -q --no-deps --target 'build/$(TRANSFORMERS_LOWEST)' '$(TRANSFORMERS_LOWEST)'
	PYTHONPATH='build/$(TRANSFORMERS_LOWEST)' $(BIN)/python -c 'import transformers as t; print("transformers", t.__version__); \
		assert "$(TRANSFORMERS_LOWEST)".endswith("==" + t.__version__)'
	PYTHONPATH='build/$(TRANSFORMERS_LOWEST)' $(BIN)/python -m pytest -n $(TEST_WORKERS) -p no:cacheprovider \
		tests/hf/test_retrofit.py tests/hf/test_modeling.py -k 'round_trip or pretrained or not_match'

# the quick loop while editing (under a minute on 2 cores): the float64 op, stream and model tests at
# tiny sizes, the tests tests/conftest.py marks `fast`; `make test` stays the full suite
test-fast: $(BIN)/.installed-test
	$(BIN)/python -m pytest -n $(TEST_WORKERS) -m fast

# ruff (rules in pyproject.toml), its formatter, and mypy over attnres/ ([tool.mypy]); the second ruff
# check is the same tree under ruff's defaults (--isolated: isort at 88 columns), so that the imports
# read the same to an editor or tool that does not load pyproject.toml
lint: $(BIN)/.installed-test
	$(BIN)/ruff check attnres tests
	$(BIN)/ruff check --isolated --select F,E9,I,UP --target-version py310 attnres tests
	$(BIN)/ruff format --check attnres tests
	$(BIN)/mypy

# the core is all the demo needs; `make demo DEMO_ARGS=--full` runs the full-size comparison
demo: $(BIN)/.installed
	$(BIN)/attnres demo $(DEMO_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache

# the serving oracles (docs/serving.md): mlx-lm's kimi_k3 against our Kimi Linear models (float32, 1e-4)
# and the GGUF structure; llama.cpp itself: scripts/llama_cpp_parity.py
test-serving: $(BIN)/.installed-test
	$(BIN)/python -m pip install -q -e '.[mlx]'
	$(BIN)/python -m pytest -n 0 tests/serving
