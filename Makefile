# The README's two commands: `make demo` and `make test`. Both build .venv from nothing when it is missing.
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c
PYTHON ?= python3
# pip warns about this machine's extra index folders that do not exist; the filter keeps real errors visible.
QUIET_PIP := 2>&1 | { grep -v 'is ignored: it is neither a file nor a directory' || true; }
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-quick setup clean lint gpu-check gpu-check-compat compare-methods

setup: $(STAMP)

# torch and the build tools go in first so that DeepSpeed (an sdist whose setup.py imports torch) builds against
# the pinned CPU torch without build isolation instead of pulling a CUDA torch into an isolated build environment.
$(STAMP): setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade "pip>=24" "setuptools>=69,<80" wheel $(QUIET_PIP)
	$(PY) -m pip install --quiet "torch==2.13.0" "numpy>=1.26,<3" packaging psutil py-cpuinfo ninja hjson msgpack einops "pydantic>=2" $(QUIET_PIP)
	DS_BUILD_OPS=0 $(PY) -m pip install --quiet --no-build-isolation "deepspeed>=0.15,<0.20" $(QUIET_PIP)
	$(PY) -m pip install --quiet -e ".[test]" $(QUIET_PIP)
	$(PY) -m pipeline.eval.lm_eval.plugin
	touch $(STAMP)

# The main job on the bundled default: tokenize the Python standard library, train the matched GRT and dense
# quickstart models, evaluate both (early-exit curves), log everything to MLflow, print the comparison.
demo: $(STAMP)
	@start=$$(date +%s); \
	$(VENV)/bin/grt run recipes/quickstart-grt.yaml && \
	$(VENV)/bin/grt run recipes/quickstart-dense.yaml && \
	$(VENV)/bin/grt compare quickstart-grt quickstart-dense && \
	echo "demo: done in $$(( $$(date +%s) - start )) s (set-up not included)"

# The paper's methods side by side at toy scale (recipes/compare/): dense, GRT, Poisson, MoR, RRT and Ouro on the same
# tokens and block executions, each trained, evaluated and logged; then one table and one overlay plot.
METHODS := dense grt poisson mor rrt ouro
compare-methods: $(STAMP)
	@start=$$(date +%s); \
	for m in $(METHODS); do $(VENV)/bin/grt run recipes/compare/$$m.yaml || exit $$?; done; \
	$(VENV)/bin/grt compare $(addprefix methods-,$(METHODS)) --out runs/compare-methods --format markdown && \
	echo "compare-methods: done in $$(( $$(date +%s) - start )) s"

# ruff (ruff.toml: pycodestyle, pyflakes, import order, lines <= 120) over the tree, in seconds; `make test` runs it
# first, so a lint failure fails the suite. `$(PY) -m ruff check --fix .` sorts imports and drops unused ones.
lint: $(STAMP)
	$(PY) -m ruff check .

# The full suite, what CI runs (.ci/run): lint, then every test (26 min on 2 cores: 1543 s at 20d4b10).
test: lint
	$(PY) -m pytest -q --durations=25 tests

# Every module's unit tests, lint first, in 2 min on 2 cores (`make test-quick` on an idle machine: 120 s, 438 tests
# in 109 s): no test that starts processes of its own (torchrun ranks, `grt` commands, servers: marked multiprocess;
# the tokenizer's worker pool still forks inside tokenize's tests), no slow one, and one case of each parametrized
# test (tests/conftest.py marks the rest further_case; pytest.ini lists the marks).
test-quick: lint
	$(PY) -m pytest -q -m "not slow and not multiprocess and not gpu and not further_case" tests

# For a lent CUDA machine (torch and triton preinstalled there, nothing else; `python3 bench/gpu_check.py` is the same
# without make): the CUDA tests and the GPU benchmarks, each phase in its own process under its own time cap (8.2 min in
# all), $$OUT/gpu_check.json (else runs/gpu-check/) rewritten after every phase. Here (no CUDA) it is a dry run with
# the .venv's Python. GPU_CHECK_ARGS: e.g. --only gate_op,train_d or --cap-scale 2 (bench/gpu_check.py --help).
GPU_PY := $(shell test -x $(PY) && echo $(PY) || echo $(PYTHON))
gpu-check:
	$(GPU_PY) bench/gpu_check.py $(GPU_CHECK_ARGS)

# `make gpu-check` under the GPU image's versions, here on the CPU (docs/gpu-check.md): a venv of torch 2.11.0 (the
# PyPI wheel: CUDA 13 libraries, ~3 GB to download once; it runs on a CPU), triton 3.6.0, numpy and psutil (the image
# has both; train_fsdp's trainer uses them) and nothing else, then every phase's modules imported with the packages
# the image lacks blocked, the
# Triton kernels' checks in Triton's interpreter, and the dry run of every phase (Triton's interpreter, tiny sizes),
# train_fsdp also with inductor. Not part of `make test` (the download; 5-12 min on 2 busy cores).
COMPAT := .venv-gpu-compat
COMPAT_STAMP := $(COMPAT)/.installed
# the image's Python (3.12) where this machine has one that runs
COMPAT_PYTHON := $(shell python3.12 -c '' 2>/dev/null && echo python3.12 || echo $(PYTHON))
$(COMPAT_STAMP): Makefile
	test -x $(COMPAT)/bin/python || $(COMPAT_PYTHON) -m venv $(COMPAT)
	$(COMPAT)/bin/python -m pip install --quiet "torch==2.11.0" "triton==3.6.0" "numpy>=2,<3" psutil $(QUIET_PIP)
	touch $(COMPAT_STAMP)

gpu-check-compat: $(COMPAT_STAMP)
	@start=$$(date +%s); out=runs/gpu-check-compat; \
	$(COMPAT)/bin/python bench/gpu_check.py --check-imports > /dev/null && \
	TRITON_INTERPRET=1 $(COMPAT)/bin/python bench/gpu_check.py --interpreted-kernels > /dev/null && \
	TRITON_INTERPRET=1 $(COMPAT)/bin/python bench/gpu_check.py --tiny --all --cap-scale 2 --out $$out/tiny \
	  > /dev/null && \
	$(COMPAT)/bin/python bench/gpu_check.py --only train_fsdp --out $$out/inductor > /dev/null && \
	echo "gpu-check-compat: torch $$($(COMPAT)/bin/python -c 'import torch; print(torch.__version__)') passed in \
	$$(( $$(date +%s) - start )) s ($$out/)"

clean:
	rm -rf $(VENV) runs data mlflow.db mlruns .pytest_cache .ruff_cache
