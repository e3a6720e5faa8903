# Both entry points set themselves up: a fresh machine needs only python3 (>= 3.10) and make.
# CPU machines get torch pinned to a CPU build; to reuse an existing CUDA torch instead:
#   make test VENV_ARGS=--system-site-packages TORCH=
# The venvs are made from python3's own version, in the distribution's build where one can make venvs
# (/usr/bin/python3.X): distributions build CPython with PGO and LTO, pyenv's default build has neither,
# and the suite (dynamo, torch.export, Triton's interpreter: Python-bound) did 16% more work under it, side by
# side on one machine. PYTHON=... chooses another.
SYSTEM_PYTHON := $(shell python3 -c 'import sys; print("/usr/bin/python%d.%d" % sys.version_info[:2])' 2>/dev/null)
PYTHON ?= $(if $(shell $(SYSTEM_PYTHON) -c 'import ensurepip, venv' 2>/dev/null && echo yes),$(SYSTEM_PYTHON),python3)
# `make gpu` runs on the machine's own torch, wherever python3 has it.
GPU_PYTHON ?= python3
VENV ?= .venv
VENV_ARGS ?=
TORCH ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.patchc-installed

.PHONY: demo test test-full gpu compat compat-torch setup clean

demo: $(STAMP)
	$(PY) -m patchc prune

# Two pytest workers, each file on one of them (its module fixtures built once): ~25% off the suite on
# 2 cores. TEST_WORKERS=0 runs it in this process.
TEST_WORKERS ?= 2
# The suite also compiles and interprets the kernels under the Triton that GPU machines with torch 2.11
# have (test_codegen_compile.py, test_bench.py), so the rare GPU session does not find them broken; empty: skip.
COMPAT_TRITON ?= 3.6.0
test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# The same suite with the larger form of some slow checks too (`pytest --full`: every model family of the
# matrix, sm_80 under the older Triton, `patchc recover` under torchrun, ...): about 80 s more of 2 cores.
test-full: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --full

# The GPU proof (`patchc bench`): runs from the working tree with the machine's own torch + triton and
# installs nothing (GPU machines may have no network). BENCH_ARGS="--parts check" etc. narrows it.
gpu:
	PYTHONPATH=. PYTHONUNBUFFERED=1 $(GPU_PYTHON) -m patchc bench $(BENCH_ARGS)

# An older Triton beside the venv's own, in $(VENV)/triton-<version> (with the numpy < 2.4 that 3.6's
# interpreter needs), put on PYTHONPATH where wanted; installed whole or not at all.
install_triton = test -d $(VENV)/triton-$(1) || { rm -rf $(VENV)/triton-$(1).part && \
	$(PY) -m pip install -q --no-deps --target $(VENV)/triton-$(1).part "triton==$(1)" "numpy<2.4" && \
	mv $(VENV)/triton-$(1).part $(VENV)/triton-$(1); }

# The kernels under the older Tritons a GPU machine may have (torch 2.11 comes with 3.6): compiles every
# variant for sm_80 and sm_90 on this CPU and prints each weight loop's static cost (records appended to
# benchmarks/results/static_profile.jsonl). Installs only those triton wheels, inside the venv.
TRITONS ?= 3.6.0 3.7.0 3.8.0
compat: $(STAMP)
	@for v in $(TRITONS); do \
	  $(call install_triton,$$v) || exit 1; \
	  echo "== triton $$v"; \
	  PYTHONPATH=$(VENV)/triton-$$v:. $(PY) benchmarks/static_profile.py --shape 4096x4096 --sparsity 0.45 0.5 \
	    --dtype fp16 bf16 --tile 128 64 || exit 1; \
	done

# The whole suite under the torch GPU machines have (2.11, with their transformers 5.17), in a venv of its
# own inside $(VENV) (a CUDA build of torch, ~6 GB; its Triton 3.6 needs numpy < 2.4 to interpret): what
# CI's CPU torch 2.13 cannot show. Installs from the package index; not part of `make test`.
COMPAT_TORCH ?= torch==2.11.0 transformers==5.17.0
COMPAT_VENV ?= $(VENV)/torch-compat
compat-torch:
	test -x $(COMPAT_VENV)/bin/python || $(PYTHON) -m venv $(COMPAT_VENV)
	$(COMPAT_VENV)/bin/python -m pip install -q $(COMPAT_TORCH) "numpy<2.4"
	$(COMPAT_VENV)/bin/python -m pip install -q -e ".[test,hf,minilm]"
	$(COMPAT_VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile -p no:cacheprovider

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV_ARGS) $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(if $(strip $(TORCH)),$(PY) -m pip install -q "$(TORCH)")
	$(PY) -m pip install -q -e ".[test,hf,minilm]"
	$(if $(strip $(COMPAT_TRITON)),$(call install_triton,$(COMPAT_TRITON)) || \
	  echo "make setup: triton==$(COMPAT_TRITON) could not be installed (no wheel for this platform?); its checks will skip")
	touch $(STAMP)

clean:
	rm -rf $(VENV) runs .pytest_cache
