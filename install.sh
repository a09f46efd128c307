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
