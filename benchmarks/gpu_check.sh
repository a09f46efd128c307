#!/usr/bin/env bash
# The one prepared device check of the CUDA path, under 8 minutes on one GPU:
#   1. tests, compiled for CUDA, stopping at the first failure: the Triton kernels
#      (tests/plugins/test_triton_kernels.py) and the CUDA path (tests/executor:
#      decode graphs vs eager, graphs over the compiled forward (engine.compile)
#      vs eager, greedy tokens CUDA vs CPU per backend, every backend's attention
#      at the Qwen3-0.6B heads, KV sizing, pinned staging);
#   2. benchmarks/gpu_throughput.py: Qwen3-0.6B shape, 256 requests, output tok/s
#      and decode roofline per attention backend, engine option cuda_graphs off and
#      on (on: graph-safe backends only), KV cache sized by the engine from
#      gpu_memory_utilization=0.9.
# Everything lands in $OUT (default /tmp/servelab-gpu): env.txt, tests.log,
# bench.log, gpu_throughput.{md,json}, and gpu_check.{json,md}: every phase with its
# exit status, seconds and time limit, then the throughput table (printed last).
#
# Usage:
#   bash benchmarks/gpu_check.sh --dry-run [FOLDER]  # on a CPU: every phase at tiny shapes
#                                           # (a few tests each, Triton interpreted, the tiny
#                                           # model), results under FOLDER (default $OUT);
#                                           # limits x DRY_RUN_SCALE (4), the table shows the plan's
#   bash benchmarks/gpu_check.sh --vendor   # here, once: copy the pure-Python packages the
#                                           # GPU image lacks (omegaconf, antlr4) into .pydeps/
#   bash benchmarks/gpu_check.sh            # on the GPU machine, with .pydeps/ copied beside the tree
#   COMPILE_ROW=1 bash benchmarks/gpu_check.sh   # ... plus a row of triton_paged with engine.compile
#                                           # and graphs on (60 s more: past the 8-minute plan)
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

DRY=0
if [ "${1:-}" = "--dry-run" ]; then
    DRY=1
    [ -n "${2:-}" ] && OUT=$2
fi
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/servelab-gpu}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
if [ "$DRY" -eq 1 ]; then
    export TRITON_INTERPRET=1 # no GPU: the kernels run interpreted
else
    unset TRITON_INTERPRET # compile the kernels; the interpreter is for CPU-only machines
fi

if [ "$DRY" -eq 0 ] && ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
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
    command -v nvidia-smi >/dev/null && nvidia-smi -L
    "$PYTHON" - <<'EOF'
import importlib.util, torch, triton
name = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
print("torch", torch.__version__, "triton", triton.__version__, name)
print("torch.nn.attention.varlen:", importlib.util.find_spec("torch.nn.attention.varlen") is not None)
print("flash_attn:", importlib.util.find_spec("flash_attn") is not None)
EOF
} 2>&1 | tee "$OUT/env.txt"

# Time plan (worst case, every timeout hit): setup 15 s, tests 80 + 100 + 30 + 35 s,
# benchmark 45 + 60 + 50 + 25 + 25 s, report 10 s: 475 s. A timed-out
# phase still leaves its log and the rest runs. triton_paged's graphs-on engine captures ~20 buckets while
# it is built. Each phase is one process under its own `timeout`, recorded in phases.tsv.
PHASES="$OUT/phases.tsv"
: >"$PHASES"
# name, then: time limit, what to run (a test path and pytest options, or backend graphs
# max-seconds); the dry run takes a few tests of each file and the tiny model. The executor
# phase leaves out test_compile.py and the CPU tensor-parallel modules (CPU engines only, run
# by the CPU suite); compile with CUDA graphs runs for real in test_compile_graphs.py, tensor
# parallelism on CUDA in test_tensor_parallel_cuda.py (two ranks over gloo on one device,
# NCCL and per-rank graphs where there are two).
CPU_ONLY=""
for module in compile tensor_parallel tensor_parallel_failures tensor_parallel_graphs; do
    CPU_ONLY+=" --ignore=tests/executor/test_$module.py"
done
TEST_PHASES=("tests:executor 80 tests/executor$CPU_ONLY" "tests:triton_kernels 100 tests/plugins/test_triton_kernels.py"
    "tests:triton_fused 30 tests/kernels/test_triton_fused.py" "tests:triton_sm90 35 tests/plugins/test_triton_sm90.py")
BENCH_PHASES=("bench:triton_paged-off 45 triton_paged off 20" "bench:triton_paged-on 60 triton_paged on 20"
    "bench:flash_varlen-off 50 flash_varlen off 30" "bench:padded-off 25 padded off 10"
    "bench:per_request-off 25 per_request off 10")
# COMPILE_ROW=1 adds triton_paged with engine.compile and graphs on: torch.compile of the
# model (about a minute at the Qwen3-0.6B shape) does not fit the 8-minute plan beside the rest
[ "${COMPILE_ROW:-0}" = 1 ] && BENCH_PHASES+=("bench:triton_paged-on+compile 60 triton_paged on 15 --compile")
# the dry run's few tests: one quick test of each file (names as pytest -k takes them)
declare -A DRY_TESTS=([tests:executor]="test_graph_buckets_rejects_an_empty_engine"
    [tests:triton_kernels]="test_empty_batch_returns_empty_output"
    [tests:triton_fused]="test_empty_batches_launch_nothing"
    [tests:triton_sm90]="test_decode_attention_keeps_four_blocks_per_sm")
for spec in "${TEST_PHASES[@]}" "${BENCH_PHASES[@]}"; do
    read -r name limit _ <<<"$spec"
    printf '%s\tplanned\t-\t%s\t-\n' "$name" "$limit" >>"$PHASES"
done

# the dry run's phases interpret kernels on a (maybe busy) CPU: their limits are scaled
SCALE=1
[ "$DRY" -eq 1 ] && SCALE=${DRY_RUN_SCALE:-4}
phase() { # name limit log command...: runs one phase, appends its record
    local name=$1 limit=$2 log=$3
    shift 3
    local begin=$SECONDS
    timeout "$((limit * SCALE))" "$@" 2>&1 | tee -a "$OUT/$log"
    local rc=${PIPESTATUS[0]}
    printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - begin))" "$limit" "$log" >>"$PHASES"
    return "$rc"
}

echo "== CUDA tests (compiled kernels) =="
# each kernel shape compiles its own variant: spread the compiles over 4 workers
parallel=()
[ "$DRY" -eq 0 ] && "$PYTHON" -c "import xdist" 2>/dev/null && parallel=(-n 4)
begin=$SECONDS
tests_rc=0
# The CPU engines in these tests would first build the C++ CPU kernels (~2 min on a fresh box)
export SERVELAB_CPU_KERNEL=0
for spec in "${TEST_PHASES[@]}"; do
    read -r name limit file options <<<"$spec"
    read -ra options <<<"${options:-}"
    select=()
    [ "$DRY" -eq 1 ] && select=(-k "${DRY_TESTS[$name]}")
    phase "$name" "$limit" tests.log "$PYTHON" -m pytest -x -q -ra -p no:cacheprovider \
        "${parallel[@]}" "${select[@]}" "${options[@]}" "$file" || tests_rc=$?
done
unset SERVELAB_CPU_KERNEL
echo "tests: exit $tests_rc in $((SECONDS - begin)) s"

echo "== throughput benchmark =="
# One process per backend and graphs mode: a crash or a timeout costs one row, not the
# table, and each run's memory returns to the device. Graphs on only for the graph-safe
# backend (the others would run eagerly, as off). Slow backends get less time; a run
# stopped at --max-seconds reports its partial rate.
begin=$SECONDS
bench_rc=0
runs=$(mktemp -d)
tiny=()
[ "$DRY" -eq 1 ] && tiny=(--tiny --requests 2 --min-len 2 --max-len 8 --variants)
for spec in "${BENCH_PHASES[@]}"; do
    read -r name limit backend graphs seconds options <<<"$spec"
    read -ra options <<<"${options:-}"
    phase "$name" "$limit" bench.log "$PYTHON" benchmarks/gpu_throughput.py "${tiny[@]}" \
        --backends "$backend" --graphs "$graphs" --max-seconds "$seconds" "${options[@]}" \
        --out "$runs/${name#bench:}" || bench_rc=$?
done
echo "benchmark: exit $bench_rc in $((SECONDS - begin)) s"
# one process without torch: merges the runs' reports, then the phases' and theirs
timeout 10 "$PYTHON" benchmarks/gpu_report.py --check "$OUT" "$runs"/*
echo "tests exit $tests_rc, benchmark exit $bench_rc"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
