# One-command set-up: every target creates the virtual environment and installs what it needs when missing.
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: run test test-fast lint docs bench clean-venv docker-image

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# the CPU build of torch; a looser pin would pull a multi-GB CUDA build
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

# The main job: a local swarm (3 volunteer daemons, 2 trainers) training a byte-level transformer language model
# on the Python standard library's source, every layer's FFN served by the daemons; one daemon is SIGKILLed 10 s
# after both trainers report training progress, to show them carrying on. Ends with held-out bits per byte (beside
# the figure the same model reaches trained locally for as many steps, measured by benchmarks/bench_lm.py) and a
# sample continuation. About 3 minutes on 2 busy cores. Ctrl-C stops everything (the trainers still report; exit
# status 130). The digits classifier: `peer swarm up --kill-one-at 10`.
run: $(STAMP)
	$(BIN)/peer swarm up --task lm --steps 150 --batch-size 8 --target-batch-size 512 --kill-one-at 10

# Everything CI runs: static checks (ruff; mypy, strict on every product module), the
# documentation site (a broken link or a missing page fails it), the default (fast) suite and beside it the
# simulations in virtual time marked slow, two at a time (what they see does not depend on the load, and the
# default suite must pass on busy cores: together they take minutes less than one after the other; their output
# follows the default suite's), then the rest of the slow scenarios (real processes, sockets and clocks) one at a
# time.
test: lint docs $(STAMP)
	@sims=$$(mktemp); \
	$(BIN)/python -m pytest -q -m "slow and virtual_time" -n 2 --dist worksteal --durations=10 >$$sims 2>&1 & \
	pid=$$!; \
	$(BIN)/python -m pytest -q --durations=15; fast=$$?; \
	wait $$pid; sim=$$?; \
	echo "== the slow simulations in virtual time (run beside the default suite):"; cat $$sims; rm -f $$sims; \
	test $$fast -eq 0 && { test $$sim -eq 0 || test $$sim -eq 5; }
	$(BIN)/python -m pytest -q -m "slow and not virtual_time" --durations=15 || test $$? -eq 5

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy

# The default suite only (a few minutes): for the edit-test loop.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q --durations=15

# The documentation site: docs/ as configured by mkdocs.yml, built in strict mode (any warning fails: a broken
# link or anchor, a page missing from the nav or a nav entry without its page, an API reference that does not
# resolve) into site/ (git-ignored). Installs the `docs` extra into the virtual environment when missing.
DOCS_STAMP := $(VENV)/.docs-stamp

$(DOCS_STAMP): $(STAMP) pyproject.toml
	$(BIN)/python -m pip install --quiet -e '.[docs]'
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	$(BIN)/mkdocs build --strict

bench: $(STAMP)
	for bench in benchmarks/bench_*.py; do $(BIN)/python $$bench || exit 1; done

# The peer image, swarmd:latest: a wheelhouse of the project's dependency set (the only step that uses the network),
# then docker/Dockerfile built from it with no network. DOCKER_BASE=local builds FROM a Debian base made with
# debootstrap (root; made once, cached by tag) for machines with no container registry; the default base is
# python:3.11-slim. Prints the image size.
docker-image: $(STAMP)
	PYTHON=$(BIN)/python docker/build-image.sh $(if $(filter local,$(DOCKER_BASE)),--local-base)

clean-venv:
	rm -rf $(VENV)
