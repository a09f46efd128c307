#!/usr/bin/env bash
# Creates .venv and installs servelab with its dev extras (tests, oracle, benchmarks).
# PyTorch's CPU wheel goes in first: an unpinned torch pulls a multi-GB CUDA build.
# Elsewhere, point TORCH_INDEX_URL at a CPU wheel index (or set TORCH_SPEC for a CUDA build).
set -euo pipefail
cd "$(dirname "$0")"
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q "${TORCH_SPEC:-torch==2.13.0}" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
python -m pip install -q -e ".[dev]"
# Build the C++ CPU kernels now, once (cached in ~/.cache/servelab/kernels, or
# $SERVELAB_KERNEL_CACHE, keyed by their sources, flags, torch, Python and CPU), so
# neither the first engine nor the tests pay for it; a failed build is logged and
# the engine then keeps torch's ops (see servelab/kernels/cpp_extension.py)
python -m servelab.kernels  # in parallel processes, one per core
