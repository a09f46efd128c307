"""End-to-end output throughput on a GPU, per attention backend, CUDA graphs off/on.

The workload nano-vllm and vLLM publish: the Qwen3-0.6B shape with random
weights (servelab model `qwen3-0.6b`), 256 requests whose prompt and output
lengths are uniform in [100, 1024], seed 0, `ignore_eos`, bf16.

    python benchmarks/gpu_throughput.py                      # CUDA, every backend
    python benchmarks/gpu_throughput.py --backends triton_paged --graphs on
    python benchmarks/gpu_throughput.py --tiny               # CPU smoke test, tiny model
    python benchmarks/gpu_throughput.py --backends triton_paged --graphs on --compile

Every backend runs the same requests: `--first N` runs only the first N of the
workload's (a slow backend's row says "first N of 256 requests"), so rates
compare. `--phase-seconds` is the one deadline of the whole process (import,
engine build, compiles, warm-up, timed run; see `gpu_phase.py`); `--records
FILE` appends each run's row as it goes, so a run killed at its limit leaves a
row saying where it stopped. A failed step or a request ending in an error makes
the row an error naming it, with no figures.

Figures per run:
- output tok/s: sampled tokens / wall time of the timed run (warm-up excluded);
- decode roofline: a decode step must read every weight once and every
  scheduled sequence's KV context once; those bytes over the device bandwidth
  (measured here with a large copy) are the step's floor. The fraction is
  sum(floors) / sum(wall times) over the decode-only steps.

CUDA graphs are the engine option `cuda_graphs` (the status column adds the
engine's `graphs_status` and its replay count); `--compile` sets `engine.compile`
(torch.compile over the model's torch ops, attention eager; the graphs column then
reads `on+compile`). On CUDA the engine sizes its KV
cache itself from `gpu_memory_utilization`; on the CPU (`--tiny`) it gets
`kv_cache_memory` = what the workload can hold at once. Every run is warmed up
first with every kernel variant the timed run can launch (see `warm_up`; with graphs,
the capture happens when the engine is built); `--variants` checks it launch by launch.
"""

from __future__ import annotations

import time

STARTED = time.monotonic()  # the phase's limit counts from here: before torch is imported

import argparse  # noqa: E402
import contextlib  # noqa: E402
import gc  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402

import torch  # noqa: E402

# the benchmark's own modules sit beside it (also when a test loads this file by path)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kernel_variants  # noqa: E402
from gpu_phase import Phase, PhaseTimeout, StepFailed, StepShapes  # noqa: E402
from gpu_report import RunResult, merge, table, write_report  # noqa: E402
from gpu_workload import (  # noqa: E402
    Workload,
    make_workload,
    measure_bandwidth,
    warm_up,
)

from servelab import LLM, ConfigError, SamplingParams  # noqa: E402
from servelab.engine.build import attention_backend  # noqa: E402
from servelab.executor.cuda_graphs import backend_is_graph_safe  # noqa: E402
from servelab.model.config import named_config  # noqa: E402

CUDA_BACKENDS = ("triton_paged", "flash_varlen", "padded", "per_request")
TINY_BACKENDS = ("per_request", "padded", "flash_varlen")


# -- one run


def workload_kv_bytes(args, config, workload: Workload) -> int:
    """KV bytes for every sequence the workload can run at once (the CPU run's
    `kv_cache_memory`; on CUDA the engine sizes its cache from the device)."""
    kv_per_token = config.kv_bytes_per_token(args.dtype)
    blocks_per_seq = -(-args.max_model_len // args.block_size) + 1
    need = min(len(workload.prompts), args.max_num_seqs) * blocks_per_seq * args.block_size
    return need * kv_per_token


def build_llm(args, backend: str, graphs: bool, kv_bytes: int | None) -> LLM:
    """The engine for one run; `kv_bytes` None lets the engine size its KV cache
    from `gpu_memory_utilization`."""
    attention = {"name": "flash_varlen", "impl": "auto"} if backend == "flash_varlen" else backend
    options = dict(
        device=args.device,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        seed=0,
        cuda_graphs=graphs,
        compile=args.compile,
    )
    if args.device == "cpu":
        # tiny kernels: one thread, as conf/device/cpu.yaml; spinning threads collapse on shared cores
        options["num_threads"] = 1
    if kv_bytes is None:
        options["gpu_memory_utilization"] = args.gpu_memory_utilization
    else:
        options["kv_cache_memory"] = kv_bytes
    allocator = {"name": "paged", "block_size": args.block_size}
    return LLM(model=args.model, attention=attention, allocator=allocator, **options)


def timed_run(
    llm: LLM, workload: Workload, max_seconds: float, deadline: float = float("inf")
) -> tuple[int, float, list]:
    """Runs the workload, stopping at `max_seconds` or the phase's `deadline`
    (`time.monotonic()`); returns (requests done, wall seconds, [(StepRecord,
    StepShape)] of the timed steps). A failed step or an errored request: StepFailed."""
    engine = llm.engine
    shapes = StepShapes(engine)
    first_record = len(engine.metrics.steps)
    failures_before = dict(engine.step_failures)
    for prompt, n in zip(workload.prompts, workload.output_lens):
        engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    done, errors = 0, []
    begin = time.perf_counter()
    while (
        engine.has_unfinished()
        and time.perf_counter() - begin < max_seconds
        and time.monotonic() < deadline
    ):
        outputs = engine.step()
        done += len(outputs)
        errors += [o.error for o in outputs if o.error]
    if engine.executor.device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - begin
    failed = {
        key: n - failures_before.get(key, 0)
        for key, n in engine.step_failures.items()
        if n > failures_before.get(key, 0)
    }
    if failed or errors:
        where = ", ".join(f"{n} in {stage} ({kind})" for (stage, kind), n in failed.items())
        first = f"; first: {errors[0]}" if errors else ""
        raise StepFailed(
            f"{sum(failed.values())} failed steps{': ' + where if where else ''}, "
            f"{len(errors)} requests ended in an error{first}"
        )
    return done, wall, shapes.pair(engine.metrics.steps[first_record:])


def run_one(
    args, backend: str, graphs: bool, workload, bandwidth, phase: Phase | None = None
) -> RunResult:
    """One backend and graphs mode: a row with figures, or with the error or the
    stage it stopped in and none. The row is written at every stage (`phase`)."""
    phase = phase or Phase(time.monotonic(), None, None)
    result = RunResult(
        backend, mode_label(args, graphs), requests=len(workload.prompts), bandwidth=bandwidth
    )
    result.notes += workload_notes(args)
    config = named_config(args.model)
    llm = None
    try:
        phase.enter("building the engine (weights, KV cache, graph capture)", result)
        kv_bytes = None if args.device == "cuda" else workload_kv_bytes(args, config, workload)
        try:
            llm = build_llm(args, backend, graphs, kv_bytes)
        except ConfigError as err:
            result.status = f"config error: {err}"
            return result
        except Exception as err:  # e.g. a graph capture failing while the engine is built
            traceback.print_exc()
            result.status = f"error building: {type(err).__name__}: {err}"
            return result
        phase.enter("warming up (first compiles)", result)
        recorder = kernel_variants.VariantRecorder() if args.variants else None
        with recorder or contextlib.nullcontext():
            warm_up(llm, args, config.vocab_size)
            warm_keys = recorder.take() if recorder else set()
            compiled_before = kernel_variants.compiled_variants()
            dynamo_before = dynamo_graphs()
            phase.enter("timed run", result)
            done, wall, paired = timed_run(llm, workload, args.max_seconds, phase.deadline)
        result.notes += variant_notes(recorder, warm_keys, compiled_before)
        if args.compile:
            result.notes.append(
                f"{dynamo_graphs() - dynamo_before} dynamo graphs compiled while timed"
            )
        weight_bytes = sum(
            p.numel() * p.element_size() for p in llm.engine.executor.model.parameters()
        )
        result.kv_cache_bytes = llm.engine.executor.kv_cache.device_pool.nbytes
        figures(result, paired, weight_bytes, config.kv_bytes_per_token(args.dtype))
        result.requests_done, result.wall_s = done, wall
        result.output_tok_s = result.output_tokens / wall if wall > 0 else 0.0
        result.status = "ok"
        if done < len(workload.prompts):
            stop = "the phase deadline" if time.monotonic() >= phase.deadline else "--max-seconds"
            result.status = f"partial: {done} of {len(workload.prompts)} requests by {stop}"
        if graphs:
            result.notes += graph_notes(llm.engine.executor.runner)
    except PhaseTimeout as err:
        result.status = str(err)
        phase.write(result)  # at once: SIGKILL follows SIGTERM within seconds
    except StepFailed as err:
        result.status = f"error: {err}"
    except Exception as err:  # one backend's failure is a row of the table, not the end
        traceback.print_exc()
        result.status = f"error: {type(err).__name__}: {err}"
    finally:
        del llm  # no other reference may keep the engine (its KV cache) alive past here
        free_device_memory(args.device)
        phase.write(result)
    return result


def figures(result: RunResult, paired: list, weight_bytes: int, kv_per_token: int) -> None:
    """Output tokens, decode rate and decode roofline fraction of the timed steps."""
    result.output_tokens = sum(step.sampled_tokens for step, _ in paired)
    decode = [(s, shape) for s, shape in paired if shape.decode_only]
    result.decode_steps = len(decode)
    decode_wall = sum(s.wall_time for s, _ in decode)
    if decode and decode_wall > 0:
        result.decode_tok_s = sum(s.sampled_tokens for s, _ in decode) / decode_wall
        floor = sum(weight_bytes + sh.context_tokens * kv_per_token for _, sh in decode)
        result.roofline_fraction = floor / result.bandwidth / decode_wall


def workload_notes(args) -> list[str]:
    """Says when a run takes only the first requests of the shared workload."""
    if args.first is not None and args.first < args.requests:
        return [f"first {args.first} of {args.requests} requests"]
    return []


def mode_label(args, graphs: bool) -> str:
    """The graphs column: `on` / `off`, `+compile` with `--compile`."""
    return ("on" if graphs else "off") + ("+compile" if args.compile else "")


def dynamo_graphs() -> int:
    """Graphs torch.compile has compiled in this process (0 where it never ran)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def variant_notes(recorder, warm_keys: set, compiled_before: int | None) -> list[str]:
    """Kernel variants first launched (recorded) or compiled (cache sizes) in the timed run."""
    notes = []
    compiled_after = kernel_variants.compiled_variants()
    if compiled_before is not None and compiled_after is not None:
        notes.append(f"{compiled_after - compiled_before} Triton variants compiled while timed")
    if recorder is not None:
        new = recorder.keys - warm_keys
        notes.append(f"{len(warm_keys)} kernel variants warmed, {len(new)} new while timed")
    return notes


def graph_notes(runner) -> list[str]:
    notes = [f"graphs {runner.graphs_status}"]
    if runner.graphs is not None and runner.graphs.enabled:
        notes.append(
            f"{runner.graphs.num_replays} decode replays, {runner.graphs.num_eager} eager forwards"
        )
    return notes


def free_device_memory(device: str) -> None:
    """Returns a finished run's memory, so the next engine sizes its KV cache from
    the whole device (it reads what is free)."""
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--tiny", action="store_true", help="CPU smoke test: tiny model, 8 short requests"
    )
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument(
        "--backends", nargs="+", default=None, help=f"default: {' '.join(CUDA_BACKENDS)}"
    )
    p.add_argument("--graphs", choices=("off", "on", "both"), default="both")
    p.add_argument("--requests", type=int, default=256, help="the workload every backend shares")
    p.add_argument(
        "--first", type=int, default=None, help="run only the first N requests (a slow backend)"
    )
    p.add_argument("--min-len", type=int, default=100)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--max-seconds", type=float, default=120.0, help="per run; partial runs say so")
    p.add_argument(
        "--phase-seconds",
        type=float,
        default=None,
        help="the whole process's deadline (import, build, compiles, warm-up, timed run)",
    )
    p.add_argument("--records", default=None, help="append each run's row (JSON lines) here")
    p.add_argument("--bandwidth-bytes", type=int, default=2 * 1024**3, help="size of the copy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--variants",
        action="store_true",
        help="record every Triton launch's variant key (a few us a launch) and report new ones",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="engine.compile=true: torch.compile over the model's torch ops, attention eager",
    )
    p.add_argument("--out", default=None, help="folder for gpu_throughput.{md,json} (default $OUT)")
    p.add_argument(
        "--merge", nargs="+", metavar="FOLDER", help="merge earlier runs' reports, run nothing"
    )
    args = p.parse_args(argv)
    if args.tiny:
        args.model, args.device, args.dtype = "tiny", "cpu", "float32"
        args.requests = min(args.requests, 8)
        if (args.min_len, args.max_len) == (100, 1024):  # not given: the tiny lengths
            args.min_len, args.max_len = 4, 32
        args.max_num_seqs, args.max_num_batched_tokens = 8, 256
        args.block_size, args.bandwidth_bytes = 4, 64 * 1024**2
        args.backends = args.backends or list(TINY_BACKENDS)
    args.backends = args.backends or list(CUDA_BACKENDS)
    args.max_model_len = 2 * args.max_len
    args.max_num_batched_tokens = max(args.max_num_batched_tokens, args.max_model_len)
    if args.out is None and os.environ.get("OUT"):
        args.out = os.environ["OUT"]
    return args


def graph_safe(args, backend: str) -> bool:
    spec = {"name": "flash_varlen", "impl": "auto"} if backend == "flash_varlen" else backend
    return backend_is_graph_safe(attention_backend(spec, named_config(args.model)))


def plan_runs(args) -> list[tuple[str, bool, str | None]]:
    """(backend, cuda_graphs, reason to skip or None). Graphs on with a backend
    that is not graph-safe would run eagerly, the same as off: skipped."""
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.graphs]
    runs = []
    for backend in args.backends:
        for graphs in modes:
            if graphs and not graph_safe(args, backend):
                runs.append((backend, True, "backend not graph-safe: same as off"))
            else:
                runs.append((backend, graphs, None))
    return runs


def main(argv=None, started: float | None = None) -> list[RunResult]:
    """Runs the planned runs; `started` (default now) is when the phase's clock started."""
    args = parse_args(argv)
    if args.merge:
        print(merge(args.merge, args.out))
        return []
    phase = Phase(
        time.monotonic() if started is None else started, args.phase_seconds, args.records
    )
    previous = signal.getsignal(signal.SIGTERM)
    if args.phase_seconds is not None:
        phase.raise_on_sigterm()
    try:
        return run_planned(args, phase)
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_planned(args, phase: Phase) -> list[RunResult]:
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --tiny on a CPU")
    device = torch.device(args.device)
    config = named_config(args.model)
    workload = make_workload(
        args.requests, args.min_len, args.max_len, config.vocab_size, args.seed
    )
    header = (
        f"{args.model} ({args.dtype}): {len(workload.prompts)} requests, prompt and "
        f"output lengths uniform in [{args.min_len}, {args.max_len}], "
        f"{workload.num_output_tokens} output tokens"
    )
    workload.prompts, workload.output_lens = (
        workload.prompts[: args.first],
        workload.output_lens[: args.first],
    )
    runs = plan_runs(args)
    results = [
        RunResult(
            backend,
            mode_label(args, graphs),
            status=skip or "not started",
            requests=len(workload.prompts),
        )
        for backend, graphs, skip in runs
    ]
    for row in results:  # every planned row on disk before anything can hang
        phase.write(row)
    first = next((r for r, (_, _, skip) in zip(results, runs) if not skip), None)
    if first is None:  # every run skipped
        print(write_report(args, header, results))
        return results
    try:
        phase.enter("measuring the copy bandwidth", first)
        bandwidth = measure_bandwidth(device, args.bandwidth_bytes)
    except PhaseTimeout as err:
        first.status = str(err)
        phase.write(first)
        return results
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    header += f"; {name}"
    phase.write_header(header)
    print(header, flush=True)
    for i, (backend, graphs, skip) in enumerate(runs):
        if skip:
            continue
        if any(r.status.startswith("timed out") for r in results):
            results[i].status = "not started: the phase timed out"
            phase.write(results[i])
            continue
        results[i] = run_one(args, backend, graphs, workload, bandwidth, phase)
        print(table(results[i : i + 1]).splitlines()[-1], flush=True)
        write_report(args, header, results)  # after every run: a timeout keeps the rest
    print("\n" + write_report(args, header, results))
    return results


def exit_status(results: list[RunResult]) -> int:
    """124 when a run timed out, 1 when one failed, else 0 (the phase's record)."""
    if any(r.status.startswith("timed out") for r in results):
        return 124
    failed = ("error", "config error", "running", "not started")
    return 1 if any(r.status.startswith(failed) for r in results) else 0


if __name__ == "__main__":
    status = exit_status(main(started=STARTED))
    sys.stdout.flush()
    sys.stderr.flush()
    # every row is on disk: skip the interpreter's teardown (freeing a CUDA context and
    # torch's threads), which could outlast the 5 s between `timeout`'s SIGTERM and SIGKILL
    os._exit(status)
