#!/usr/bin/env bash
# The one prepared device check of the CUDA path, under 8 minutes on one GPU:
#   1. tests, compiled for CUDA, stopping at the first failure: the Triton kernels
#      (tests/plugins/test_triton_kernels.py) and the CUDA path (tests/executor:
#      decode graphs vs eager, greedy tokens CUDA vs CPU per backend, every
#      backend's attention at the Qwen3-0.6B heads, KV sizing, pinned staging);
#   2. benchmarks/gpu_throughput.py: Qwen3-0.6B shape, 256 requests, output tok/s
#      and decode roofline per attention backend, engine option cuda_graphs off and
#      on (on: graph-safe backends only), KV cache sized by the engine from
#      gpu_memory_utilization=0.9.
# Everything lands in $OUT (default /tmp/servelab-gpu): env.txt, tests.log,
# bench.log, gpu_throughput.md, gpu_throughput.json; the merged table prints last.
#
# Usage:
#   bash benchmarks/gpu_check.sh --vendor   # here, once: copy the pure-Python packages the
#                                           # GPU image lacks (omegaconf, antlr4) into .pydeps/
#   bash benchmarks/gpu_check.sh            # on the GPU machine, with .pydeps/ copied beside the tree
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
PYDEPS=${PYDEPS:-.pydeps}
VENDORED=(omegaconf antlr4) # the engine's config layer and its parser; pyyaml is on the image

if [ "${1:-}" = "--vendor" ]; then
    # Pure Python, so a copy from this environment runs under the image's Python too
    # (antlr4-python3-runtime 4.9.3 has no wheel to carry instead, only an sdist).
    mkdir -p "$PYDEPS"
    for pkg in "${VENDORED[@]}"; do
        src=$("$PYTHON" -c "import $pkg, os; print(os.path.dirname($pkg.__file__))") || exit 1
        rm -rf "${PYDEPS:?}/$pkg"
        cp -r "$src" "$PYDEPS/$pkg"
    done
    find "$PYDEPS" -name __pycache__ -prune -exec rm -rf {} +
    # keep it out of git (copy it to the GPU machine with the tree)
    if [ "$PYDEPS" = .pydeps ] && [ -d .git ] && ! grep -qx "/.pydeps/" .git/info/exclude 2>/dev/null; then
        mkdir -p .git/info && echo "/.pydeps/" >>.git/info/exclude
    fi
    echo "vendored ${VENDORED[*]} into $PYDEPS ($(du -sh "$PYDEPS" | cut -f1))"
    exit 0
fi

unset TRITON_INTERPRET # compile the kernels; the interpreter is for CPU-only machines
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/servelab-gpu}
mkdir -p "$OUT"

if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "no CUDA device: on a CPU run 'pytest tests/executor' and" \
        "'python benchmarks/gpu_throughput.py --tiny' instead" >&2
    exit 2
fi

# servelab importable without installing: the same folder mapping as setup.py
if ! "$PYTHON" -c "import servelab.plugins.attention" 2>/dev/null; then
    site=$(mktemp -d)
    cp -r core "$site/servelab"
    cp -r plugins "$site/servelab/plugins"
    cp -r conf "$site/servelab/conf"
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
if ! "$PYTHON" -c "import omegaconf" 2>/dev/null; then
    if [ ! -d "$PYDEPS/omegaconf" ]; then
        echo "omegaconf is missing here and $PYDEPS/ was not carried: run" \
            "'bash benchmarks/gpu_check.sh --vendor' on the dev machine and carry .pydeps" >&2
        exit 3
    fi
    PYTHONPATH="$(cd "$PYDEPS" && pwd)${PYTHONPATH:+:$PYTHONPATH}"
    export PYTHONPATH
fi
"$PYTHON" -c "from servelab import LLM; import servelab.executor.cuda_graphs, servelab.executor.device_memory" || exit 3

{
    nvidia-smi -L
    "$PYTHON" - <<'EOF'
import importlib.util, torch, triton
print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())
print("torch.nn.attention.varlen:", importlib.util.find_spec("torch.nn.attention.varlen") is not None)
print("flash_attn:", importlib.util.find_spec("flash_attn") is not None)
EOF
} 2>&1 | tee "$OUT/env.txt"

# Time plan (worst case, every timeout hit): setup 15 s, tests 80 + 100 + 30 + 40 s,
# benchmark 45 + 60 + 50 + 25 + 25 s: 470 s. A timed-out step still leaves its log and
# the rest runs. triton_paged's graphs-on engine captures ~20 buckets while it is built.
echo "== CUDA tests (compiled kernels) =="
# each kernel shape compiles its own variant: spread the compiles over 4 workers
parallel=()
"$PYTHON" -c "import xdist" 2>/dev/null && parallel=(-n 4)
begin=$SECONDS
tests_rc=0
# The CPU engines in these tests would first build the C++ CPU kernels (~2 min on a fresh box)
export SERVELAB_CPU_KERNEL=0
for spec in "tests/executor 80" "tests/plugins/test_triton_kernels.py 100" \
    "tests/kernels/test_triton_fused.py 30" "tests/plugins/test_triton_sm90.py 40"; do
    read -r file seconds <<<"$spec"
    timeout "$seconds" "$PYTHON" -m pytest -x -q -ra -p no:cacheprovider "${parallel[@]}" "$file" \
        2>&1 | tee -a "$OUT/tests.log"
    rc=${PIPESTATUS[0]}
    [ "$rc" -ne 0 ] && tests_rc=$rc
done
unset SERVELAB_CPU_KERNEL
echo "tests: exit $tests_rc in $((SECONDS - begin)) s"

echo "== throughput benchmark =="
# One process per backend: a crash or a timeout costs one backend, not the table.
# Slow backends get less time; a run stopped at --max-seconds reports its partial rate.
begin=$SECONDS
bench_rc=0
runs=$(mktemp -d)
# One process per backend and graphs mode: each run's memory returns to the device.
# Graphs on only for the graph-safe backend (the others would run eagerly, as off).
for spec in "triton_paged off 20 45" "triton_paged on 20 60" "flash_varlen off 30 50" \
    "padded off 10 25" "per_request off 10 25"; do
    read -r backend graphs seconds limit <<<"$spec"
    timeout "$limit" "$PYTHON" benchmarks/gpu_throughput.py --backends "$backend" --graphs "$graphs" \
        --max-seconds "$seconds" --out "$runs/$backend-$graphs" 2>&1 | tee -a "$OUT/bench.log"
    rc=${PIPESTATUS[0]}
    [ "$rc" -ne 0 ] && bench_rc=$rc
done
echo "benchmark: exit $bench_rc in $((SECONDS - begin)) s"
"$PYTHON" benchmarks/gpu_throughput.py --merge "$runs"/* --out "$OUT"
echo "tests exit $tests_rc, benchmark exit $bench_rc"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
