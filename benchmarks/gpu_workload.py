"""The throughput benchmark's workload, its warm-up and the device's copy bandwidth
(`gpu_throughput.py` runs them).

The workload is a function of (count, lengths, vocabulary, seed) only, so every
backend's process builds the same requests. The warm-up launches, before the
clock starts, every kernel variant the timed run can launch, and fails the run
(StepFailed) when one of its requests ends in an error: a run whose warm-up
failed would time something else.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass

import torch
from gpu_phase import StepFailed

from servelab import LLM, SamplingParams

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
        check_outputs(llm.generate(prompts(1, length), short(2)), "warming up")
    for bucket in captured_buckets(llm):
        check_outputs(llm.generate(prompts(bucket, 4), short(3)), "warming up")
    count = min(32, args.max_num_seqs)
    warm = make_workload(count, args.min_len // 4 + 1, args.max_len // 4 + 1, vocab_size, seed=1)
    outputs = llm.generate(warm.prompts, [short(min(n, 64)) for n in warm.output_lens])
    check_outputs(outputs, "warming up")


def check_outputs(outputs, where: str) -> None:
    """A request that ended in an error (its step raised: a kernel error, an
    out-of-memory) means the run measured something else: StepFailed."""
    errors = [o.error for o in outputs if o.error]
    if errors:
        raise StepFailed(f"{len(errors)} requests failed while {where}: {errors[0]}")


def captured_buckets(llm: LLM) -> tuple[int, ...]:
    """The decode batch sizes the engine captured graphs for (none when eager)."""
    graphs = llm.engine.executor.runner.graphs
    return tuple(graphs.buckets) if graphs is not None and graphs.enabled else ()
