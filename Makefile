# The two commands of the README:
#   make demo   set everything up and run the embedded demo (SQLite, embedded broker, no server)
#   make test   set everything up and run the tests on PostgreSQL + Redis
# Both bootstrap a virtual environment in .venv from pyproject.toml.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
INSTALLED := $(VENV)/.installed

TEST_DATABASE_URL ?= postgres://postgres@127.0.0.1:5432/nightwatch
TEST_REDIS_URL ?= redis://127.0.0.1:6379/15
# The slowest tests are listed after the run: the suite's 30-minute budget is spent there.
PYTEST_ARGS ?= --durations=25 --durations-min=10

.PHONY: demo test lint system-deps services clean bench bench-quick bench-chaos bench-fleet

$(INSTALLED): pyproject.toml dashboard/frontend/package-lock.json
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[server,train,dev,bench]'
	# The dashboard's chart library (uPlot), exactly as locked; served by Django as static files.
	cd dashboard/frontend && npm ci --no-audit --no-fund
	touch $@

# Options of the demo command go in DEMO_ARGS, e.g. make demo DEMO_ARGS="--port 8001 --no-job".
DEMO_ARGS ?=

demo: $(INSTALLED)
	env -u DATABASE_URL -u REDIS_URL $(BIN)/python manage.py demo $(DEMO_ARGS)

system-deps:
	bash scripts/install-system-deps.sh

services:
	bash scripts/ensure-services.sh

lint: $(INSTALLED)
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/lint-imports --no-cache
	env -u DATABASE_URL -u REDIS_URL NIGHTWATCH_VAR_DIR=$$(mktemp -d) $(BIN)/python manage.py makemigrations --check --dry-run

test: $(INSTALLED) system-deps services lint
	DATABASE_URL=$(TEST_DATABASE_URL) REDIS_URL=$(TEST_REDIS_URL) $(BIN)/pytest $(PYTEST_ARGS)

# Every benchmark of bench/ in sequence (see ../shared/BENCHMARKS.md), then the report under
# docs/benchmarks/ (its plots use the `bench` extra, matplotlib, which the tests of the report need too).
# `make bench` fits the 45 minutes by running the chaos benchmark once (a 30-minute run, both sides
# at the same time); `make bench-chaos` runs it three times for the spread (about 95 minutes). The
# chaos report covers the newest three kept runs with the same settings, from whichever invocation.
BENCHMARKS := ckpt_blocking hook_overhead ingest recovery snapshot live_push pages chaos
BENCH_ARGS ?=
CHAOS_ARGS ?= --runs 1

bench: $(INSTALLED) services
	set -e; all=$$(date +%s); for name in $(BENCHMARKS); do \
		extra=$$([ $$name = chaos ] && echo "$(CHAOS_ARGS)" || true); \
		if [ -f bench/$$name.py ]; then echo "== bench.$$name $(BENCH_ARGS) $$extra"; one=$$(date +%s); \
			$(BIN)/python -m bench.$$name $(BENCH_ARGS) $$extra; \
			echo "== bench.$$name took $$(( $$(date +%s) - one )) s"; \
		else echo "== bench.$$name: not in this checkout, skipped"; fi; \
	done; \
	echo "== every benchmark took $$(( $$(date +%s) - all )) s"
	$(BIN)/python -m bench.report

bench-quick:
	$(MAKE) bench BENCH_ARGS=--quick

bench-chaos: $(INSTALLED) services
	$(BIN)/python -m bench.chaos --runs 3
	$(BIN)/python -m bench.report

# The fleet scale benchmark (issue 18): 64, 256 and 1,024 simulated nodes through the real control
# plane, then docs/benchmarks/fleet.md. Not part of `make bench` (about 30 minutes); FLEET_ARGS=--quick
# runs 64 nodes in under 5.
FLEET_ARGS ?=
bench-fleet: $(INSTALLED) services
	$(BIN)/python -m bench.fleet $(FLEET_ARGS)
	$(BIN)/python -m bench.report

clean:
	rm -rf $(VENV) var staticfiles .pytest_cache .ruff_cache dashboard/frontend/node_modules
