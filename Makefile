# Both entry points set themselves up: a fresh machine needs only python3 (>= 3.10) and make.
# CPU machines get torch pinned to a CPU build; to reuse an existing CUDA torch instead:
#   make test VENV_ARGS=--system-site-packages TORCH=
PYTHON ?= python3
VENV ?= .venv
VENV_ARGS ?=
TORCH ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.patchc-installed

.PHONY: demo test gpu setup clean

demo: $(STAMP)
	$(PY) -m patchc prune

test: $(STAMP)
	$(PY) -m pytest -q

# The GPU proof (`patchc bench`): runs from the working tree with the machine's own torch + triton and
# installs nothing (GPU machines may have no network). BENCH_ARGS="--parts check" etc. narrows it.
gpu:
	PYTHONPATH=. PYTHONUNBUFFERED=1 $(PYTHON) -m patchc bench $(BENCH_ARGS)

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV_ARGS) $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(if $(strip $(TORCH)),$(PY) -m pip install -q "$(TORCH)")
	$(PY) -m pip install -q -e ".[test,hf,minilm]"
	touch $(STAMP)

clean:
	rm -rf $(VENV) runs .pytest_cache
