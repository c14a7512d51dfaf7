# Two commands do everything:  make run  (Redis, web and worker)  and  make test;
# make test-fast runs the tests that start no process and load no model (two pytest processes).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TINY := .cache/tiny-model

.PHONY: install run test test-fast lint lock tiny-model clean image-test

# pyproject.toml declares the project and its groups; `make lock` turns it
# into the requirements*.txt locks (every distribution pinned, with hashes),
# which are what gets installed, hashes required. `make run` installs what
# running needs (requirements-run.txt: web and worker), `make test` and
# `make install` the test set on top (requirements-test.txt).
install: $(VENV)/.test

$(VENV)/.run: requirements-run.txt
	$(call venv_install,requirements-run.txt)
	touch $@

$(VENV)/.test: requirements-test.txt
	$(call venv_install,requirements-test.txt)
	touch $(VENV)/.run $@

# On Linux the CPU locks pin torch's CPU build, which PyTorch's CPU index serves:
# scripts/torch-source adds `--extra-index-url $$TORCH_INDEX_URL` (default
# https://download.pytorch.org/whl/cpu; a mirror may stand in) unless that torch
# is installed already or a wheel of it lies in a find-links folder.
define venv_install
	@$(call supported_python,$$(test -x $(BIN)/python && echo $(BIN)/python || echo $(PYTHON)))
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --no-compile --require-hashes $$($(BIN)/python scripts/torch-source $(1)) -r $(1)
	# Bytecode for what pip installed, on every core (pip compiles one file at a time: about half of
	# a fresh install's time on 2 cores). As with pip, a file that does not compile is skipped (torch
	# ships a few in syntax newer than this Python); Python reads their source if they are imported.
	$(BIN)/python -m compileall -qq -j 0 $(VENV)/lib/python3*/site-packages || true
	# PyPI's torchaudio is a CUDA build whose native libraries do not load
	# beside torch 2.13; ChatTTS uses only its pure-Python parts, which work
	# without them.
	rm -f $(VENV)/lib/python3*/site-packages/torchaudio/lib/*.so
endef

# The locks serve Python 3.11, 3.12 and 3.13 (pyproject.toml's requires-python): with another, pip would
# fail on a hash or a resolution far into the install, so make stops first and says which to install.
define supported_python
	v=$$($(1) -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null) || v=; \
	case $$v in 3.11|3.12|3.13) ;; \
	  *) echo "make: this project needs Python 3.11, 3.12 or 3.13, and $(1) is $${v:+Python }$${v:-no Python that runs}." \
	       "Install one of them, then: make PYTHON=python3.12 $(MAKECMDGOALS) (or put it first on PATH)" >&2; exit 1 ;; \
	esac
endef

lock: $(VENV)/.test
	scripts/lock $(BIN)/uv

# Web and worker from the Procfile (honcho), on $REDIS_URL or a private Redis.
# Without real weights (no TTS_MODEL_PATH, hub unreachable) the worker says
# so and runs on the tiny random checkpoint.
run: $(VENV)/.run
	@url=$$(scripts/redis-url $(BIN)/python) && \
	echo "Redis: $$url" && \
	REDIS_URL=$$url TTS_FALLBACK_MODEL_PATH=$(TINY) PATH=$(abspath $(BIN)):$$PATH exec $(BIN)/honcho start --port $${PORT:-8000}

# ruff (lint and format) and mypy, as pyproject.toml sets them.
lint: $(VENV)/.test
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# The linters run beside the tests (mypy keeps one core busy while the test
# processes start); either failing fails `make test`, the linters' output last.
# The slowest tests are listed at the end (--durations): where the suite's time goes.
test: $(VENV)/.test
	@mkdir -p .cache && url=$$(scripts/redis-url $(BIN)/python) && \
	{ $(MAKE) --no-print-directory lint > .cache/lint.log 2>&1 & lint=$$!; } && \
	REDIS_URL=$$url $(BIN)/python -m pytest -q -rs --durations=15 -n $${TEST_PROCESSES:-4} --dist loadfile $(PYTEST_ARGS); \
	tests=$$?; wait $$lint; linted=$$?; cat .cache/lint.log; \
	[ $$linted -eq 0 ] || echo "make test: the linters failed (above)" >&2; \
	[ $$tests -eq 0 ] && [ $$linted -eq 0 ]

# The tests that start no process and load no model (tests/conftest.py marks the others
# `slow` and fails a fast test that starts a process), in two pytest processes, no linters.
test-fast: $(VENV)/.test
	@url=$$(scripts/redis-url $(BIN)/python) && \
	REDIS_URL=$$url $(BIN)/python -m pytest -q -rs -m "not slow" -n $${TEST_PROCESSES:-2} $(PYTEST_ARGS)

tiny-model: $(VENV)/.run
	$(BIN)/python -m engines.tiny_checkpoint $(TINY)

clean:
	rm -rf $(VENV) .cache .pytest_cache

# The Dockerfile's images built and run here without an image registry (scripts/image-test says how; root,
# buildah and debootstrap, which it installs with apt-get): the cpu image serves a request, the gpu image
# is built. It skips, saying why, where it cannot run.
image-test: $(VENV)/.run
	scripts/image-test

# Benchmarks (bench/run.py, BENCHMARKS.md says what each scenario measures):
# a private redis-server, the web process, workers on the tiny checkpoint and
# the two baselines (docs/development.md says how long); the table goes to stdout and
# into BENCHMARKS.md. BENCH_QUICK=1: a short smoke run (writes nothing). On a GPU machine:
# bench/gpu.sh.
.PHONY: bench wrk soak
bench: $(VENV)/.test wrk
	$(BIN)/python bench/run.py --write BENCHMARKS.md

# wrk (a C HTTP load generator, Debian's package) drives the cache-hit
# scenario: a Python client on the same 2 cores saturates before the server.
wrk:
	@command -v wrk >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing wrk (apt-get)"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq wrk >/dev/null; \
	  else \
	    echo "wrk is missing: install it (Debian/Ubuntu: sudo apt-get install wrk; macOS: brew install wrk)" >&2; \
	    exit 1; \
	  fi; }

# A bounded soak (bench/soak.py): mixed load at about 70% of capacity for
# SOAK_MINUTES (10) while workers restart on --max-jobs, one is SIGKILLed and
# Redis (AOF on) restarts once; writes its section of BENCHMARKS.md.
soak: $(VENV)/.test
	$(BIN)/python bench/soak.py --minutes $${SOAK_MINUTES:-10} $(SOAK_ARGS) --write BENCHMARKS.md
