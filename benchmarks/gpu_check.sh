#!/usr/bin/env bash
# The one prepared device check of the CUDA path, planned to end within 6 minutes on
# one GPU (phase limits: setup 15 + tests 100 + benchmark 235 + report 10 = 360 s),
# leaving time for a rerun when 15 minutes of device time are lent:
#   1. tests:gpu: the CUDA tests and the tests that run the GPU path where a GPU is
#      (markers `cuda` and `gpu_path`: the Triton kernels, the fused forward, decode
#      graphs vs eager, compile + graphs, greedy tokens CUDA vs CPU per backend,
#      attention at the Qwen3-0.6B heads, KV sizing, pinned staging), compiled, no -x:
#      one run collects every failure;
#   2. bench:*: benchmarks/gpu_throughput.py, one process per backend and graphs mode,
#      Qwen3-0.6B shape, bf16, the same 256 requests for every backend (the slow ones
#      the first 64 / 32 of them, said in their row), engine option cuda_graphs off and
#      on (on: graph-safe backends only), KV cache sized by the engine from
#      gpu_memory_utilization=0.9. Each process's limit covers its whole life (import,
#      weights, graph capture, compiles, warm-up, timed run); its row is on disk from
#      the moment it starts, so a phase cut off at its limit says where it stopped.
# The sm_90 register check needs no GPU: it runs on the CPU (tests/plugins/test_triton_sm90.py).
# Results, 6 files in $OUT (default /tmp/servelab-gpu): env.txt, tests.log, bench.log,
# records.jsonl (every phase and run as it goes), gpu_check.{json,md} (the merged report:
# every phase with its status, seconds and limit, then the throughput table).
#
# Usage:
#   bash benchmarks/gpu_check.sh --dry-run [FOLDER]  # on a CPU: every phase at tiny shapes
#                                           # (a few tests each, Triton interpreted, the tiny
#                                           # model), results under FOLDER (default $OUT);
#                                           # limits x DRY_RUN_SCALE (4), the table shows the plan's
#   bash benchmarks/gpu_check.sh --vendor   # here, once: copy the pure-Python packages the
#                                           # GPU image lacks (omegaconf, antlr4) into .pydeps/
#   bash benchmarks/gpu_check.sh            # on the GPU machine, with .pydeps/ carried beside the tree
#   COMPILE_ROW=1 bash benchmarks/gpu_check.sh   # ... plus a row of triton_paged with engine.compile
#                                           # and graphs on (60 s more: past the 6-minute plan)
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
    # the tiny CPU engines would first build the C++ CPU kernels (minutes), which no GPU run uses
    export SERVELAB_CPU_KERNEL=0
else
    unset TRITON_INTERPRET # compile the kernels; the interpreter is for CPU-only machines
fi

# name, time limit in seconds, then what to run: the tests' pytest arguments, or a
# benchmark run's backend, graphs mode and the first N of the 256 requests (0: all).
TESTS_SPEC='tests:gpu 100 -m "cuda or gpu_path" tests/executor tests/plugins tests/kernels'
BENCH_PHASES=("bench:triton_paged-off 50 triton_paged off 0" "bench:triton_paged-on 55 triton_paged on 0"
    "bench:flash_varlen-off 50 flash_varlen off 0" "bench:padded-off 40 padded off 64"
    "bench:per_request-off 40 per_request off 32")
# COMPILE_ROW=1 adds triton_paged with engine.compile and graphs on: torch.compile of the
# model (about a minute at the Qwen3-0.6B shape) does not fit the 6-minute plan beside the rest
[ "${COMPILE_ROW:-0}" = 1 ] && BENCH_PHASES+=("bench:triton_paged-on+compile 60 triton_paged on 0 --compile")
PLAN=("setup 15" "$TESTS_SPEC" "${BENCH_PHASES[@]}" "report 10")
# the dry run's few tests, one of each kind the real phase runs (names as pytest -k takes them)
DRY_TESTS="test_empty_batch_returns_empty_output or test_empty_batches_launch_nothing"
DRY_TESTS+=" or test_one_big_bucket_pads_a_single_sequence"
# the dry run's phases interpret kernels on a (maybe busy) CPU: their limits are scaled
SCALE=1
[ "$DRY" -eq 1 ] && SCALE=${DRY_RUN_SCALE:-4}

RECORDS="$OUT/records.jsonl"
: >"$RECORDS"
for file in env.txt tests.log bench.log gpu_check.json gpu_check.md; do : >"$OUT/$file"; done
record() { # name rc seconds limit log: one phase record (planned, started or done)
    printf '{"kind": "phase", "name": "%s", "rc": "%s", "seconds": "%s", "limit_s": "%s", "log": "%s"}\n' \
        "$@" >>"$RECORDS"
}
for spec in "${PLAN[@]}"; do
    read -r name limit _ <<<"$spec"
    record "$name" planned - "$limit" -
done
phase() { # name limit log command...: runs one phase under its limit, recorded at start and end
    local name=$1 limit=$2 log=$3
    shift 3
    local begin=$SECONDS
    record "$name" started - "$limit" "$log"
    # SIGTERM 5 s before the limit (a benchmark writes its row), SIGKILL at the limit
    timeout -k 5 "$((limit * SCALE - 5))" "$@" 2>&1 | tee -a "$OUT/$log"
    local rc=${PIPESTATUS[0]}
    record "$name" "$rc" "$((SECONDS - begin))" "$limit" "$log"
    return "$rc"
}

# setup: in this shell (it exports PYTHONPATH for the phases), each step under a limit
echo "== setup =="
begin=$SECONDS
record setup started - 15 env.txt
setup_failed() { # rc message
    echo "${*:2}" >&2
    record setup "$1" "$((SECONDS - begin))" 15 env.txt
    timeout 10 "$PYTHON" benchmarks/gpu_report.py --check "$OUT" >/dev/null
    exit "$1"
}
# servelab importable without installing: the same folder mapping as setup.py
if ! "$PYTHON" -c "import importlib.util as u, sys; sys.exit(u.find_spec('servelab') is None)"; then
    site=$(mktemp -d)
    cp -r core "$site/servelab"
    cp -r plugins "$site/servelab/plugins"
    cp -r conf "$site/servelab/conf"
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
if ! "$PYTHON" -c "import omegaconf" 2>/dev/null; then
    if [ ! -d "$PYDEPS/omegaconf" ]; then
        setup_failed 3 "omegaconf is missing here and $PYDEPS/ was not carried: run" \
            "'bash benchmarks/gpu_check.sh --vendor' on the dev machine and carry .pydeps" \
            "with the tree (it is git-ignored: name it in what copies the tree)"
    fi
    PYTHONPATH="$(cd "$PYDEPS" && pwd)${PYTHONPATH:+:$PYTHONPATH}"
    export PYTHONPATH
fi
# one process imports torch once: the device, the versions, then servelab's engine imports
{
    command -v nvidia-smi >/dev/null && nvidia-smi -L
    DRY=$DRY timeout "$((15 * SCALE))" "$PYTHON" - <<'EOF'
import importlib.util, os, sys, torch, triton
name = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
print("torch", torch.__version__, "triton", triton.__version__, name)
print("torch.nn.attention.varlen:", importlib.util.find_spec("torch.nn.attention.varlen") is not None)
print("flash_attn:", importlib.util.find_spec("flash_attn") is not None)
if os.environ["DRY"] == "0" and not torch.cuda.is_available():
    sys.exit(2)
from servelab import LLM  # noqa: F401  (the engine's imports: a missing dependency shows here)
import servelab.executor.cuda_graphs, servelab.executor.device_memory  # noqa: F401
EOF
} 2>&1 | tee "$OUT/env.txt"
rc=${PIPESTATUS[0]}
[ "$rc" -eq 2 ] && setup_failed 2 "no CUDA device: on a CPU run 'bash benchmarks/gpu_check.sh --dry-run' instead"
[ "$rc" -eq 0 ] || setup_failed 3 "servelab does not import here (exit $rc): see env.txt"
record setup 0 "$((SECONDS - begin))" 15 env.txt

echo "== tests:gpu (compiled kernels) =="
# The CPU engines some of these tests build would first compile the C++ CPU kernels
cpu_kernel=${SERVELAB_CPU_KERNEL-unset}
export SERVELAB_CPU_KERNEL=0
read -r name limit pytest_args <<<"$TESTS_SPEC"
eval "pytest_args=($pytest_args)" # the quoted marker expression stays one argument
options=(-q -ra -p no:cacheprovider)
# each kernel shape compiles its own variant: spread the compiles over 8 workers
[ "$DRY" -eq 0 ] && "$PYTHON" -c "import xdist" 2>/dev/null && options+=(-n 8)
[ "$DRY" -eq 1 ] && options+=(-k "$DRY_TESTS")
tests_rc=0
phase "$name" "$limit" tests.log "$PYTHON" -m pytest "${options[@]}" "${pytest_args[@]}" || tests_rc=$?
[ "$cpu_kernel" = unset ] && unset SERVELAB_CPU_KERNEL

echo "== throughput benchmark =="
# One process per backend and graphs mode: a crash or a timeout costs one row, not the
# table, and each run's memory returns to the device. Graphs on only for the graph-safe
# backend (the others would run eagerly, as off).
bench_rc=0
tiny=()
[ "$DRY" -eq 1 ] && tiny=(--tiny --requests 2 --min-len 2 --max-len 8 --variants)
for spec in "${BENCH_PHASES[@]}"; do
    read -r name limit backend graphs first options <<<"$spec"
    read -ra options <<<"${options:-}"
    [ "$first" -gt 0 ] && options+=(--first "$first")
    # its own deadline is its SIGTERM's: it stops its timed run MARGIN_S before, to write its row
    phase "$name" "$limit" bench.log "$PYTHON" benchmarks/gpu_throughput.py "${tiny[@]}" \
        --backends "$backend" --graphs "$graphs" --max-seconds 1e9 \
        --phase-seconds "$((limit * SCALE - 5))" --records "$RECORDS" "${options[@]}" || bench_rc=$?
done

# one process without torch: the phases' records and the runs' rows into gpu_check.{json,md}
echo "== report =="
begin=$SECONDS
record report started - 10 -
timeout 10 "$PYTHON" benchmarks/gpu_report.py --check "$OUT" >/dev/null
record report $? "$((SECONDS - begin))" 10 -
timeout 10 "$PYTHON" benchmarks/gpu_report.py --check "$OUT" # again, with its own record
echo "tests exit $tests_rc, benchmark exit $bench_rc"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
