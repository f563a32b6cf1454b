# Two entry points: `make demo` and `make test`. Both set up .venv from nothing.
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
STAMP := $(VENV)/.zbcompile-installed

.PHONY: setup browser demo test lint bench clean

setup: $(STAMP)

# Headless Chromium opens the HTML report in tests/e2e/test_inspect.py. Installed from Debian's
# package when it is missing and we are root (CI runs `make test` as root in a fresh clone);
# otherwise say how, and the screenshot test skips naming it.
CHROMIUM ?= /usr/bin/chromium
browser:
	@if [ -x $(CHROMIUM) ] || command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		{ apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends chromium; } \
			|| echo "could not install chromium: the report screenshot test will say so"; \
	else echo "no Chromium: as root, apt-get install chromium (the report screenshot test needs it)"; fi

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install "torch==$(TORCH_VERSION)"
	$(PY) -m pip install -e ".[dev]"
	touch $@

demo: setup
	$(VENV)/bin/zbcompile demo

test: setup browser
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -n 2 --dist loadgroup --durations=20

lint: setup
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info
