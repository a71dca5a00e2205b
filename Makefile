# Kunlun Platform — the two commands: `make demo` (install + local cluster) and `make test`.
.PHONY: install demo down test lint typecheck proto bench bench-check clean chaos soak dist

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
	$(VENV)/bin/lint-imports

typecheck: install
	$(VENV)/bin/mypy

test: install lint typecheck
	$(VENV)/bin/pytest -q -p no:cacheprovider
# The chaos short profile (make chaos) is not part of make test yet: its engines checker found a real
# violation (an instance id reused after a removal while the old engine's agent was frozen; see
# README "Chaos suite"). It goes back here once instance ids are unique per incarnation.

# The chaos suite (needs root: network namespaces, nftables): report in chaos-report/.
CHAOS_SEED ?= 1
chaos: install
	$(VENV)/bin/kunlun-chaos run --profile short --seed $(CHAOS_SEED) --report chaos-report --timeout 900

soak: install
	$(VENV)/bin/kunlun-chaos run --profile soak --seed $(CHAOS_SEED) --report chaos-report-soak

proto: install
	$(PY) scripts/gen_proto.py

bench: install
	$(PY) -m bench.failover
	$(PY) -m bench.heartbeats

# The wheel and the offline bundle (wheelhouse, units, examples, manifest with SHA-256 of every file).
dist: install
	$(PY) -c 'from pathlib import Path; from kunlun_installer.bundle import build; build(Path("."), Path("dist"))'

# short profiles of every benchmark vs bench/baseline.json, normalised by same-run references (not in CI)
bench-check: install
	$(PY) -m bench.check

clean: down
	rm -rf .kunlun
