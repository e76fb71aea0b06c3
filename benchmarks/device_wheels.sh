#!/usr/bin/env bash
# Wheels the GPU machine lacks, for step 6's peer: transformers' QuantizedCache with the quanto backend.
#
#   bash benchmarks/device_wheels.sh        # here (registry access) -> .whl/ (git-ignored, ~165 KB)
#
# then give the device tool's run `carry: [".whl"]`; device_run.sh installs what .whl/ holds into
# /tmp/site (no index, no dependencies: torch, ninja, numpy, safetensors and huggingface_hub are on the
# GPU image) before gpu_decode.py. optimum-quanto is pure Python; its CUDA kernels compile on first use.
set -eu
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform any \
    -d .whl "optimum-quanto==0.2.7"
ls -la .whl
