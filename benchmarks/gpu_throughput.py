"""End-to-end output throughput on a GPU, per attention backend, CUDA graphs off/on.

The workload nano-vllm and vLLM publish: the Qwen3-0.6B shape with random
weights (servelab model `qwen3-0.6b`), 256 requests whose prompt and output
lengths are uniform in [100, 1024], seed 0, `ignore_eos`, bf16.

    python benchmarks/gpu_throughput.py                      # CUDA, every backend
    python benchmarks/gpu_throughput.py --backends triton_paged --graphs on
    python benchmarks/gpu_throughput.py --tiny               # CPU smoke test, tiny model
    python benchmarks/gpu_throughput.py --backends triton_paged --graphs on --compile

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

import argparse
import contextlib
import gc
import os
import random
import statistics
import sys
import time
import traceback
from dataclasses import dataclass

import torch

# the benchmark's own modules sit beside it (also when a test loads this file by path)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kernel_variants  # noqa: E402
from gpu_report import RunResult, merge, table, write_report  # noqa: E402

from servelab import LLM, ConfigError, SamplingParams  # noqa: E402
from servelab.engine.build import attention_backend  # noqa: E402
from servelab.executor.cuda_graphs import backend_is_graph_safe  # noqa: E402
from servelab.model.config import named_config  # noqa: E402

CUDA_BACKENDS = ("triton_paged", "flash_varlen", "padded", "per_request")
TINY_BACKENDS = ("per_request", "padded", "flash_varlen")


# -- workload


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(
    num_requests: int, min_len: int, max_len: int, vocab_size: int, seed: int
) -> Workload:
    """Prompt and output lengths uniform in [min_len, max_len], random token ids."""
    rng = random.Random(seed)
    prompts, output_lens = [], []
    for _ in range(num_requests):
        prompt_len = rng.randint(min_len, max_len)
        prompts.append([rng.randrange(vocab_size) for _ in range(prompt_len)])
        output_lens.append(rng.randint(min_len, max_len))
    return Workload(prompts, output_lens)


# -- device figures


def measure_bandwidth(device: torch.device, nbytes: int, iters: int = 10) -> float:
    """Device memory bandwidth in bytes/s: a large copy, bytes read + written, median."""
    src = torch.empty(nbytes // 2, dtype=torch.float16, device=device).uniform_()
    dst = torch.empty_like(src)
    times = []
    for i in range(iters + 3):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            begin = time.perf_counter()
            dst.copy_(src)
            seconds = time.perf_counter() - begin
        if i >= 3:  # warm-up copies first
            times.append(seconds)
    del src, dst
    return 2 * (nbytes // 2) * 2 / statistics.median(times)


# -- one run


@dataclass
class StepShape:
    context_tokens: int  # sum of the scheduled sequences' context after the step
    decode_only: bool


class StepShapes:
    """Records each step's scheduled context by wrapping the scheduler's
    `schedule()`; records line up with `engine.metrics.steps` (the engine
    records a step under the same condition)."""

    def __init__(self, scheduler) -> None:
        self.shapes: list[StepShape] = []
        schedule = scheduler.schedule

        def recording_schedule():
            plan = schedule()
            if not (plan.is_empty and not plan.preempted):
                # a decode batch's rows (one token each at `decode_starts`) read as
                # arrays: listing `plan.scheduled` would add host work to every step
                batch_context = 0
                if plan.decodes is not None:
                    batch_context = int(plan.decode_starts.sum()) + plan.num_batch_decodes
                self.shapes.append(
                    StepShape(
                        context_tokens=batch_context
                        + sum(i.start + i.num_query_tokens for i in plan.items),
                        decode_only=all(i.num_query_tokens == 1 for i in plan.items),
                    )
                )
            return plan

        scheduler.schedule = recording_schedule


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


def warm_up(llm: LLM, args, vocab_size: int) -> None:
    """Runs, before the clock starts, every kernel variant the timed run can launch:
    - one prompt alone per power-of-two length up to `max_len`, and `max_len`: a step's
      attention tiles follow its longest query rounded up to a power of two, and its
      decode steps give the one-token tiles;
    - with graphs captured, a decode batch at every bucket size (each graph replays);
    - up to 32 requests of varied lengths finishing one by one (mixed prefill and
      decode steps, many batch sizes; the allocator warms up)."""
    rng = random.Random(1)

    def prompts(count: int, length: int) -> list[list[int]]:
        return [[rng.randrange(vocab_size) for _ in range(length)] for _ in range(count)]

    def short(max_tokens: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    lengths = {1 << k for k in range(args.max_len.bit_length()) if 1 << k <= args.max_len}
    for length in sorted(lengths | {args.max_len}):
        llm.generate(prompts(1, length), short(2))
    for bucket in captured_buckets(llm):
        llm.generate(prompts(bucket, 4), short(3))
    count = min(32, args.max_num_seqs)
    warm = make_workload(count, args.min_len // 4 + 1, args.max_len // 4 + 1, vocab_size, seed=1)
    llm.generate(warm.prompts, [short(min(n, 64)) for n in warm.output_lens])


def captured_buckets(llm: LLM) -> tuple[int, ...]:
    """The decode batch sizes the engine captured graphs for (none when eager)."""
    graphs = llm.engine.runner.graphs
    return tuple(graphs.buckets) if graphs is not None and graphs.enabled else ()


def timed_run(llm: LLM, workload: Workload, max_seconds: float) -> tuple[int, float, list]:
    """Runs the workload (stopping at `max_seconds`); returns (requests done,
    wall seconds, [(StepRecord, StepShape)] of the timed steps)."""
    engine = llm.engine
    shapes = StepShapes(engine.scheduler)
    first_step = len(engine.metrics.steps)
    for prompt, n in zip(workload.prompts, workload.output_lens):
        engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    done = 0
    begin = time.perf_counter()
    while engine.has_unfinished() and time.perf_counter() - begin < max_seconds:
        done += len(engine.step())
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - begin
    steps = engine.metrics.steps[first_step:]
    if len(steps) != len(shapes.shapes):  # an engine that records steps differently
        print(f"warning: {len(steps)} step records but {len(shapes.shapes)} scheduled steps")
    return done, wall, list(zip(steps, shapes.shapes))


def run_one(args, backend: str, graphs: bool, workload, bandwidth) -> RunResult:
    result = RunResult(backend, mode_label(args, graphs))
    config = named_config(args.model)
    llm = None
    try:
        kv_bytes = None if args.device == "cuda" else workload_kv_bytes(args, config, workload)
        llm = build_llm(args, backend, graphs, kv_bytes)
    except ConfigError as err:
        result.status = f"config error: {err}"
        return result
    except Exception as err:  # e.g. a graph capture failing while the engine is built
        traceback.print_exc()
        result.status = f"error building: {type(err).__name__}: {err}"
        return result
    try:
        recorder = kernel_variants.VariantRecorder() if args.variants else None
        with recorder or contextlib.nullcontext():
            warm_up(llm, args, config.vocab_size)
            warm_keys = recorder.take() if recorder else set()
            compiled_before = kernel_variants.compiled_variants()
            dynamo_before = dynamo_graphs()
            done, wall, paired = timed_run(llm, workload, args.max_seconds)
        result.notes += variant_notes(recorder, warm_keys, compiled_before)
        if args.compile:
            result.notes.append(
                f"{dynamo_graphs() - dynamo_before} dynamo graphs compiled while timed"
            )
        weight_bytes = sum(p.numel() * p.element_size() for p in llm.engine.model.parameters())
        result.kv_cache_bytes = llm.engine.kv_cache.device_pool.nbytes
        kv_per_token = config.kv_bytes_per_token(args.dtype)
        result.requests_done, result.wall_s = done, wall
        result.output_tokens = sum(step.sampled_tokens for step, _ in paired)
        result.output_tok_s = result.output_tokens / wall if wall > 0 else 0.0
        decode = [(s, shape) for s, shape in paired if shape.decode_only]
        result.decode_steps = len(decode)
        decode_wall = sum(s.wall_time for s, _ in decode)
        if decode and decode_wall > 0:
            result.decode_tok_s = sum(s.sampled_tokens for s, _ in decode) / decode_wall
            floor = sum(weight_bytes + sh.context_tokens * kv_per_token for _, sh in decode)
            result.roofline_fraction = floor / bandwidth / decode_wall
        if done < len(workload.prompts):
            result.status = f"partial: stopped at {args.max_seconds:.0f} s"
        if graphs:
            result.notes += graph_notes(llm.engine.runner)
    except Exception as err:  # one backend's failure is a row of the table, not the end
        traceback.print_exc()
        result.status = f"error: {type(err).__name__}: {err}"
    finally:
        del llm  # no other reference may keep the engine (its KV cache) alive past here
        free_device_memory(args.device)
    return result


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
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--min-len", type=int, default=100)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--max-seconds", type=float, default=120.0, help="per run; partial runs say so")
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


def main(argv=None) -> list[RunResult]:
    args = parse_args(argv)
    if args.merge:
        print(merge(args.merge, args.out))
        return []
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --tiny on a CPU")
    device = torch.device(args.device)
    config = named_config(args.model)
    workload = make_workload(
        args.requests, args.min_len, args.max_len, config.vocab_size, args.seed
    )
    bandwidth = measure_bandwidth(device, args.bandwidth_bytes)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    header = (
        f"{args.model} ({args.dtype}) on {name}: {len(workload.prompts)} requests, prompt and "
        f"output lengths uniform in [{args.min_len}, {args.max_len}], "
        f"{workload.num_output_tokens} output tokens; copy bandwidth {bandwidth / 1e9:,.0f} GB/s"
    )
    print(header, flush=True)
    results = []
    for backend, graphs, skip in plan_runs(args):
        if skip:
            results.append(RunResult(backend, mode_label(args, True), status=skip))
        else:
            results.append(run_one(args, backend, graphs, workload, bandwidth))
            print(table(results[-1:]).splitlines()[-1], flush=True)
        write_report(args, header, bandwidth, results)  # after every run: a timeout keeps the rest
    print("\n" + write_report(args, header, bandwidth, results))
    return results


if __name__ == "__main__":
    main()
