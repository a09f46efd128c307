#!/usr/bin/env bash
# Device check for our Triton kernels (triton_paged), under 8 minutes on one GPU:
#   1. tests/plugins/test_triton_kernels.py compiled for CUDA (TRITON_INTERPRET unset):
#      fp32, fp64, bf16, fp16 and the Qwen3-0.6B head shapes (16 / 8 heads, head_dim 128);
#   2. benchmarks/bench_triton_decode.py: triton_paged vs torch gather + SDPA,
#      decode at batch 64 / 256, context 1k-4k, bf16.
# Logs and the benchmark table land in $OUT (default /tmp/servelab-gpu).
# Usage, from anywhere:  bash benchmarks/gpu_kernels.sh
set -uo pipefail
cd "$(dirname "$0")/.."
unset TRITON_INTERPRET  # compile the kernels; the interpreter is for CPU-only machines
export PYTHONUNBUFFERED=1
PYTHON=${PYTHON:-python3}
OUT=${OUT:-/tmp/servelab-gpu}
mkdir -p "$OUT"

if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "no CUDA device: on a CPU run 'pytest tests/plugins/test_triton_kernels.py' (interpreted) instead" >&2
    exit 2
fi

# Make `servelab` importable without installing: the same folder mapping as setup.py.
if ! "$PYTHON" -c "import servelab.plugins.attention" 2>/dev/null; then
    site=$(mktemp -d)
    cp -r core "$site/servelab"
    cp -r plugins "$site/servelab/plugins"
    cp -r conf "$site/servelab/conf" 2>/dev/null || true
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi

nvidia-smi -L || true
"$PYTHON" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"

echo "== kernel tests (compiled) =="
# Each test shape compiles its own kernel variant: spread the compiles over 4 workers.
parallel=()
"$PYTHON" -c "import xdist" 2>/dev/null && parallel=(-n 4)
timeout 300 "$PYTHON" -m pytest -x -q -ra -p no:cacheprovider "${parallel[@]}" tests/plugins/test_triton_kernels.py \
    2>&1 | tee "$OUT/test_triton_kernels.log"
tests_rc=${PIPESTATUS[0]}

echo "== decode benchmark =="
timeout 150 "$PYTHON" benchmarks/bench_triton_decode.py --out "$OUT/bench_triton_decode.md" \
    2>&1 | tee "$OUT/bench_triton_decode.log"
bench_rc=${PIPESTATUS[0]}

echo "tests exit $tests_rc, benchmark exit $bench_rc"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
