# Two commands on a fresh machine:
#   make demo    build supermem in .venv and run the demo
#   make test    build supermem in .venv, lint, and run the tests
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test lint build sanitize tsan clean

$(BIN)/pip:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.deps: requirements-dev.txt | $(BIN)/pip
	$(BIN)/pip install -q -r requirements-dev.txt
	command -v cmake >/dev/null || $(BIN)/pip install -q cmake ninja
	touch $@

build: $(VENV)/.deps
	$(BIN)/pip install -q --no-build-isolation --no-deps -e .

demo: build
	$(BIN)/supermem demo

lint: $(VENV)/.deps
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy   # the package (pyproject's [tool.mypy]); its cache makes tests/cpu/package/test_typing.py quick

test: build lint
	$(BIN)/pytest -q

sanitize: $(VENV)/.deps   # the allocator suites under ASan + UBSan (also run by .ci/run)
	PYTHON=$(BIN)/python tools/ci/sanitize.sh

tsan: $(VENV)/.deps   # the threaded suites (threads, fork, OOM handlers) under ThreadSanitizer (also run by .ci/run)
	PYTHON=$(BIN)/python tools/ci/tsan.sh

clean:
	rm -rf build $(VENV) supermem/_C*.so
