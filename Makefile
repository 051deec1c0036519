# Every target is self-sufficient on a fresh machine with only Python 3.11+.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_STAMP := $(VENV)/.installed-torch
# Where pip finds torch==2.13.0+cpu when no local wheel has it (pip.conf's find-links does here),
# e.g. `make test TORCH_INDEX=https://download.pytorch.org/whl/cpu`.
TORCH_INDEX ?=

.PHONY: demo test test-fast lint bench chaos clean system-deps netshim dashboards

system-deps:
	./deploy/dev/system-deps.sh

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

# PyTorch CPU (torchrun + Gloo) for the end-to-end tests; a separate stamp: `make test-fast`
# and `make lint` do not need it.
$(TORCH_STAMP): $(STAMP) pyproject.toml
	$(BIN)/pip install --quiet $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) -e '.[dev,torch]'
	touch $(TORCH_STAMP)

# The shim (libnodus-netshim.so), nodus-shim-check and the shim's test programs, into
# netshim/build/ (the placer renders that path into LD_PRELOAD in local runs).
netshim: system-deps
	$(MAKE) -C netshim

demo: system-deps $(STAMP) netshim
	$(BIN)/nodus demo --netns

test: system-deps $(STAMP) $(TORCH_STAMP) netshim
	$(BIN)/pytest -q --durations=30

test-fast: $(STAMP)
	$(BIN)/pytest -q -m 'not slow'

dashboards: $(STAMP)
	$(BIN)/python -m app.observability

lint: $(STAMP)
	$(BIN)/ruff check app libs services tests
	$(BIN)/ruff format --check app libs services tests
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/python -m tests.bench.placement

# The chaos run (tests/chaos/harness.py) with the seeds that once found a bug and 6 random
# ones (SEEDS=... for others); `make test` runs seed 1, one of those (a different one each
# day) and one random seed.
CHAOS_SEEDS ?= 1 7 276742 789536 $(shell $(PYTHON) -c 'import random; print(*random.sample(range(1 << 20), 6))')
chaos: system-deps $(STAMP) netshim
	flock /tmp/nodus-netns.lock $(BIN)/python -m tests.chaos.harness $(foreach s,$(or $(SEEDS),$(CHAOS_SEEDS)),--seed $(s))

clean:
	rm -rf $(VENV) .nodus .pytest_cache .mypy_cache .ruff_cache
