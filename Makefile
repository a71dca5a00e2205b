# Kunlun Platform — the two commands: `make demo` (install + local cluster) and `make test`.
.PHONY: install demo down test lint typecheck proto bench bench-check clean

VENV := .venv
PY := $(VENV)/bin/python

install:
	@bash scripts/install.sh

demo: install
	@$(PY) -m devcluster up

down:
	@if [ -x $(PY) ]; then $(PY) -m devcluster down; else echo "nothing to stop"; fi

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: install
	$(VENV)/bin/mypy

test: install lint typecheck
	$(VENV)/bin/pytest -q -p no:cacheprovider

proto: install
	$(PY) scripts/gen_proto.py

bench: install
	$(PY) -m bench.failover
	$(PY) -m bench.heartbeats

# short profiles of every benchmark vs bench/baseline.json, normalised by same-run references (not in CI)
bench-check: install
	$(PY) -m bench.check

clean: down
	rm -rf .kunlun
