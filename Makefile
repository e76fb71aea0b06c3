# Two commands do everything on a fresh machine:  `make demo`  and  `make test`.
# Both go through `make setup`, which creates .venv and is a no-op while it is current.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.kvbits-installed
# Torch: the local CPU wheel where this machine has one (pip's find-links), else whatever pip picks. Each
# entry of PIP_FIND_LINKS (space-separated: folders, file:// URLs, remote URLs) is looked in: an unpinned torch
# takes a CUDA build of several GB.
TORCH_SPEC ?= $(shell for d in $${PIP_FIND_LINKS:-/opt/wheels}; do d=$$(printf '%s' "$$d" | sed 's,^file://,,'); \
	ls "$$d"/torch-2.13.0*.whl >/dev/null 2>&1 && { echo "torch==2.13.0"; exit 0; }; done; echo "torch")
# Tests run in pytest-xdist worker processes, one test file per worker at a time (module fixtures such as a
# loaded real model stay in one process); tests/conftest.py splits the cores' torch threads between them.
# Most tests are single-threaded Python (Triton's interpreter), so two workers on two cores halve the wall
# time (17:15 -> 9:35 for 1601 tests on this project's 2-core machine, 2026-12-02). TEST_WORKERS=0 runs them
# in this one process.
TEST_WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile

# The GPU machine's transformers (5.17; it cannot install packages): the prepared device run (cache, fused decode,
# benchmarks/gpu_decode.py) must work there, so CI also runs those tests under it (`make test-compat`: 3-7 min on
# 2026-12-06; ~2 min for its first 391 tests).
# Also the caches built from per-layer configs (test_cache_configs) and loading by hub id with no network, the
# GPU machine's case (test_hub: huggingface_hub 1.x there; about 20 s for both), RoPE tables against the models'
# own (test_rope), the seeded differential tests of both caches and the hybrid decoders' layers (test_cache_hybrid:
# transformers' linear-attention layer classes) and a left-padded chunked prefill (test_chunked_prefill: tracked
# position ids); about 100 s for these five under load, 2026-12-07. And `--device cuda:N` (test_on_device: each
# model command's Triton launches on that device's stream; 3.6 s under 5.17, 2026-12-07).
# Installed beside the venv's newer transformers, in a folder that goes first on PYTHONPATH.
TF_COMPAT     ?= 5.17.0
COMPAT_DIR    := $(VENV)/compat-transformers-$(TF_COMPAT)
COMPAT_TESTS  := tests/test_cache.py tests/test_cache_inputs.py tests/test_cache_slices.py tests/test_fused_cache.py \
                 tests/test_reserve.py tests/test_falcon_heads.py tests/test_speed.py tests/test_cache_compat.py \
                 tests/test_compile.py tests/test_static_cache.py tests/test_cache_configs.py tests/test_hub.py \
                 tests/test_rope.py tests/test_cache_differential.py tests/test_static_cache_differential.py \
                 tests/test_cache_hybrid.py tests/test_chunked_prefill.py tests/test_on_device.py

.PHONY: setup demo test test-all test-compat bench-cpu clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[test,plot]"
	# Triton for the kernels' interpreter tests, where torch brought none (the CPU wheel): a CUDA torch pins its own,
	# which an older one installed over it would break (pip only warns)
	$(BIN)/python -c "import triton" 2>/dev/null || $(BIN)/python -m pip install -q "triton==3.6.0" || echo "triton unavailable: kernel interpreter tests will be skipped"
	$(BIN)/python -m pip install -q "optimum-quanto>=0.2.6" || echo "optimum-quanto unavailable: hf-quanto peer tests will be skipped"
	touch $(STAMP)

demo: setup
	$(BIN)/python scripts/demo.py

test: setup
	$(PYTEST) -m "not slow"

test-all: setup
	$(PYTEST)

test-compat: setup
	test -d $(COMPAT_DIR) || $(BIN)/python -m pip install -q --no-deps --target $(COMPAT_DIR) \
		"transformers==$(TF_COMPAT)" "huggingface-hub>=1.5,<2" "httpx>=0.23,<1" httpcore h11
	PYTHONPATH=$(COMPAT_DIR) $(BIN)/python -c "import transformers as t; v = t.__version__; \
		assert v == '$(TF_COMPAT)', f'expected transformers $(TF_COMPAT) from $(COMPAT_DIR), got {v}'; print('transformers', v)"
	PYTHONPATH=$(COMPAT_DIR) $(PYTEST) -m "not slow" $(COMPAT_TESTS)
	PYTHONPATH=$(COMPAT_DIR) $(PYTEST) -m "not slow" tests/test_kernels.py -k gpu_benchmark

clean:
	rm -rf $(VENV) build *.egg-info
