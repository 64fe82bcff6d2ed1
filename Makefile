# steplens: `make run` (all-in-one on loopback) and `make test` are the two commands to know.
# Every target installs what it needs first, idempotently (a stamp file tracks pyproject.toml).

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
SYSTEM_STAMP := $(VENV)/.system-packages
# Debian packages the tests and the agent use: util-linux (unshare), iproute2 (netns), systemd (systemd-analyze)
APT_PACKAGES := util-linux iproute2 systemd sqlite3

.PHONY: install run test test-all bench eval proto clean install-system help

help:
	@echo "make run      collector + local agent on loopback (SQLite in ./run); Ctrl-C stops both"
	@echo "make test     install test needs and run the test suite (what CI runs)"
	@echo "make bench    benchmarks (bench/*.py), each ends with one JSON line of figures"
	@echo "make proto    regenerate proto/steplens/v1/*_pb2*.py from the .proto files"
	@echo "make install  create $(VENV) with steplens and its test needs"

install: $(STAMP)

$(SYSTEM_STAMP):
	@missing=""; for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing system packages:$$missing"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	  else echo "warning: missing system packages:$$missing (run as root with apt-get to install them)"; fi; \
	fi
	@mkdir -p $(VENV) && touch $@

$(STAMP): pyproject.toml | $(SYSTEM_STAMP)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	@touch $@

run: install
	$(VENV)/bin/steplens-collector allinone --state-dir run

test: install
	$(VENV)/bin/pytest -q -m "not gpu and not testbed" tests

bench: install
	$(PY) bench/ingest.py

proto: install
	$(PY) -m grpc_tools.protoc -I proto --python_out=proto --pyi_out=proto --grpc_python_out=proto proto/steplens/v1/*.proto

clean:
	rm -rf $(VENV) run build *.egg-info .pytest_cache
