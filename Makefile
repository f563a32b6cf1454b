# Two entry points: `make demo` and `make test`. Both set up .venv from nothing.
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
STAMP := $(VENV)/.zbcompile-installed

.PHONY: setup demo test lint bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install "torch==$(TORCH_VERSION)"
	$(PY) -m pip install -e ".[dev]"
	touch $@

demo: setup
	$(VENV)/bin/zbcompile demo

test: setup
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -n 2 --dist loadgroup

lint: setup
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info
