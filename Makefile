# Two entry points (see README): `make quickstart` and `make test`. Both create .venv on first use.
PYTHON  ?= python3
VENV    ?= .venv
# The torch wheel to install when the venv has none. CPU machines: 2.13.0 (a local CPU build).
# GPU clusters: override, e.g. TORCH_SPEC="torch==2.5.1 --index-url <your CUDA wheel index>".
TORCH_SPEC ?= torch==2.13.0
PY      := $(VENV)/bin/python
PIP     := $(PY) -m pip
# DeepSpeed must not try to compile its CUDA ops at install time.
export DS_BUILD_OPS ?= 0
# Ops compiled on first use (DeepSpeed's CPU Adam for ZeRO offload, the tests' fake-CUDA shim) go to torch's
# extension cache; one cache shared by several venvs (checkouts side by side) is rebuilt whenever another
# venv's torch uses it. (A CPU training run compiles nothing: megatron_ds.ds_compat.skip_shm_comm_op.)
export TORCH_EXTENSIONS_DIR ?= $(abspath $(VENV))/torch_extensions

.PHONY: venv install test test-gpu test-fast quickstart quickstart-bert quickstart-t5 bench clean gpu-report

# Three install stamps, so each target installs only what it runs and `make test` after `make quickstart`
# adds only the test set: the runtime (torch, requirements.txt, this package), setup.py's "hf" extra
# (transformers, for the BERT and T5 quickstarts' export), and requirements-test.txt.
RUNTIME := $(VENV)/.installed-runtime
HF      := $(VENV)/.installed-hf
TESTSET := $(VENV)/.installed-test

$(RUNTIME): setup.py pyproject.toml requirements.txt megatron_ds/data/helpers.cpp
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q $(TORCH_SPEC)
	$(PIP) install -q -r requirements.txt
	$(PIP) install -q --no-build-isolation -e .
	touch $@

$(HF): $(RUNTIME)
	$(PIP) install -q --no-build-isolation -e ".[hf]"
	touch $@

$(TESTSET): $(RUNTIME) requirements-test.txt
	$(PIP) install -q -r requirements-test.txt
	touch $@

install: $(RUNTIME)

test: $(TESTSET)
	$(PY) -m pytest -q --timeout=900 tests

# The tests marked `gpu` (tests/gpu and a few more): the real CLI, kernels and data path on CUDA
# (sized for under 10 minutes on one GPU). `make test` runs them too where CUDA exists; without, they skip.
test-gpu: $(TESTSET)
	$(PY) -m pytest -q --timeout=900 -m gpu tests

quickstart: $(RUNTIME)
	$(PY) tools/quickstart.py

quickstart-bert: $(HF)
	$(PY) tools/quickstart.py --model bert

quickstart-t5: $(HF)
	$(PY) tools/quickstart.py --model t5

clean:
	rm -rf $(VENV) build *.egg-info megatron_ds/data/*.so

# One markdown report of a GPU session (bench/gpu_report.py: ours vs the HF baseline, memory against
# the estimate, a kernel-time profile, the gpu tests) into bench/out/gpu-report.md. No venv: it runs with
# $(PYTHON), which must have the runtime and test requirements (PYTHON=.venv/bin/python after `make test`;
# on a lent GPU machine without DeepSpeed, the environment its preparation step carries there, see
# docs/testing.md). GPU_REPORT_ARGS: e.g. "--smoke", "--budget-s 420 --out report.md".
# This checkout's package comes first on the path, whatever else is installed.
GPU_REPORT_ARGS ?=
gpu-report:
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(PYTHON) bench/gpu_report.py $(GPU_REPORT_ARGS)
