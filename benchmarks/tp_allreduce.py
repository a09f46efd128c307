"""Tensor parallelism's communication against its step time, on this machine:
the same decode workload at tensor_parallel_size=1 and 2 (CPU, gloo), with
rank 0's time in its all-reduces (the embeddings' and two per layer), in the
gather of the logits and in the step message measured inside the step (wrapped
around `WorkerGroup.all_reduce`, `gather_columns` and `send`).

Prints, per configuration: the mean step time, and at TP=2 the per-step
all-reduce time and count, the gather and message times, and their share of
the step. Pin it for figures (`taskset -c 0,1` gives each rank a core; on one core
the ranks take turns and gloo's waits dominate).

    python benchmarks/tp_allreduce.py [--model bench] [--batch 8] [--steps 64]
    SERVELAB_BENCH_SMOKE=1 python benchmarks/tp_allreduce.py   (a quick check it runs)
    python benchmarks/tp_allreduce.py --device cuda [--distributed-backend gloo]

On CUDA the timed collectives synchronise the device before and after each
call, so they report the collective's own time rather than its launch (which
serialises the stream a little: the step times then include that wait too).
With one CUDA device, `--distributed-backend gloo` puts both ranks on it: it
checks the code path, its figures are not NCCL's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from servelab import LLM, SamplingParams
from servelab.executor.parallel import current_group, shutdown_workers


class Timed:
    """Wraps a bound method, adding up its wall time and calls."""

    def __init__(self, method, cuda: bool = False) -> None:
        self.method, self.seconds, self.calls = method, 0.0, 0
        self.sync = torch.cuda.synchronize if cuda else (lambda: None)

    def __call__(self, *args, **kwargs):
        self.sync()
        start = time.perf_counter()
        try:
            return self.method(*args, **kwargs)
        finally:
            self.sync()
            self.seconds += time.perf_counter() - start
            self.calls += 1


def run(model: str, tp: int, batch: int, steps: int, prompt_len: int, **engine) -> dict:
    llm = LLM(model=model, tensor_parallel_size=tp, num_threads=1, max_num_seqs=batch, **engine)
    cuda = llm.engine.executor.runner.device.type == "cuda"
    engine = llm.engine
    params = SamplingParams(max_tokens=steps, ignore_eos=True)
    llm.generate([[5] * prompt_len], SamplingParams(max_tokens=2))  # warm-up
    for i in range(batch):
        engine.add_request([4 + (i + j) % 100 for j in range(prompt_len)], params)
    engine.step()  # the prefill, not measured
    group = current_group() if tp > 1 else None
    if group is not None:  # the model and runner hold these bound methods: wrap them there
        reduce = Timed(group.all_reduce, cuda)
        engine.executor.model.set_all_reduce(reduce)
        send = Timed(group.send, cuda)
        group.send = send
        gather = Timed(group.gather_columns, cuda)
        group.gather_columns = gather
    times = []
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    result = {"tp": tp, "steps": len(times), "step_ms": 1e3 * statistics.mean(times)}
    if group is not None:
        n = len(times)
        result.update(
            all_reduce_ms=1e3 * reduce.seconds / n,
            all_reduces_per_step=reduce.calls / n,
            gather_ms=1e3 * gather.seconds / n,
            message_ms=1e3 * send.seconds / n,
        )
        comm = result["all_reduce_ms"] + result["gather_ms"] + result["message_ms"]
        result["comm_share"] = comm / result["step_ms"]
    return result


def main() -> None:
    smoke = os.environ.get("SERVELAB_BENCH_SMOKE") == "1"
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny" if smoke else "bench")
    parser.add_argument("--batch", type=int, default=2 if smoke else 8)
    parser.add_argument("--steps", type=int, default=4 if smoke else 64)
    parser.add_argument("--prompt-len", type=int, default=8 if smoke else 64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--distributed-backend", default="auto", choices=["auto", "nccl", "gloo"])
    args = parser.parse_args()
    engine = dict(
        device=args.device, dtype=args.dtype, distributed_backend=args.distributed_backend
    )
    try:
        for tp in (1, 2):
            r = run(args.model, tp, args.batch, args.steps, args.prompt_len, **engine)
            line = f"tp={r['tp']}  {r['steps']} decode steps  step {r['step_ms']:.3f} ms"
            if tp > 1:
                line += (
                    f"  all-reduce {r['all_reduce_ms']:.3f} ms/step "
                    f"({r['all_reduces_per_step']:.0f} per step)  gather {r['gather_ms']:.3f} ms"
                    f"  message {r['message_ms']:.3f} ms"
                    f"  communication {100 * r['comm_share']:.1f}% of the step"
                )
            print(line, flush=True)
    finally:
        shutdown_workers()


if __name__ == "__main__":
    main()
