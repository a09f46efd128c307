"""The engine's own CPU time per step, measured from the real engine's steps.

`servelab-calibrate --host OUT.yaml` serves a grid of workloads through the real
engine (`executor=model`, the embedded tiny model on this machine's CPU, one torch
thread) and times each step twice over: the whole `Engine.step`, and inside it the
device's share, which on a GPU would be kernels (the model's forward, the LM head,
the greedy sampler's argmax). What is left is the host work a GPU engine would also
do on its CPU: scheduling, the step's inputs and metadata, reading the tokens back
into the sequences, stop checks, the finished requests' detokenizing, the records.
It is the main thread's CPU time (`time.thread_time`), so another process on the
machine slows it less than it would the wall clock; the wall figure is kept beside it.

A non-negative least-squares fit of those seconds on the step's sequences, tokens
and finished requests' output tokens gives a host profile
(`servelab.executor.host_profile`) that `executor={name: simulated, host: ...}`
prices every simulated step's host work with.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from servelab.errors import ConfigError
from servelab.executor.cost_model import step_shape
from servelab.executor.host_profile import FIGURES, HostProfile, counts
from servelab.lab.provenance import cpu_generation, git_commit
from servelab.step.sequence import SamplingParams


@dataclass(frozen=True)
class Workload:
    """`requests` requests of `prompt` tokens and `outputs` new ones, all at once."""

    requests: int
    prompt: int
    outputs: int
    max_num_seqs: int = 256
    budget: int = 2048  # max_num_batched_tokens


# decode batches of 1 to 256 sequences over short and long contexts, and prompt chunks
# of up to 2,048 tokens beside them: the shapes a serving step takes
GRID = (
    Workload(1, 16, 64),
    Workload(8, 64, 48),
    Workload(32, 16, 32),
    Workload(64, 200, 24),
    Workload(128, 32, 16),
    Workload(256, 16, 12),
    Workload(256, 400, 8),
    Workload(16, 900, 32, budget=512),
    Workload(48, 600, 16, budget=4096),
    Workload(160, 64, 24, budget=512),  # prompts admitted beside a growing decode batch
    Workload(64, 500, 48, max_num_seqs=32, budget=1024),
)

# shapes the fit never sees, to check the fitted profile on whole runs
HELD_OUT = (
    Workload(4, 300, 100),
    Workload(96, 120, 40, max_num_seqs=64),
    Workload(200, 48, 20, budget=1024),
    Workload(24, 1500, 24, budget=768),
)


def engine_config(workload: Workload, scheduler: str, allocator: str) -> dict[str, Any]:
    return {
        "model": "tiny",
        "executor": "model",
        "scheduler": scheduler,
        "allocator": allocator,
        "attention": {"name": "flash_varlen", "impl": "cpu"},  # the backend GPU presets run
        "engine": {
            "dtype": "float32",
            "num_threads": 1,
            "max_num_seqs": workload.max_num_seqs,
            "max_num_batched_tokens": workload.budget,
            "max_model_len": workload.prompt + workload.outputs + 16,
            "kv_cache_memory": "128MiB",
        },
    }


class DeviceTimer:
    """Wraps the calls a GPU would run as kernels and adds up their time, main-thread
    CPU and wall."""

    def __init__(self) -> None:
        self.cpu = 0.0
        self.wall = 0.0

    def wrap(self, fn: Callable) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            c, w = time.thread_time(), time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.cpu += time.thread_time() - c
                self.wall += time.perf_counter() - w

        return timed


def instrument(engine: Any) -> tuple[DeviceTimer, list]:
    """Times the executor's device work (`Executor.wrap_device_work`: the real model's
    forward, LM head and argmax); keeps each step's plan."""
    timer = DeviceTimer()
    if not engine.executor.wrap_device_work(timer.wrap):
        raise ConfigError(f"executor {type(engine.executor).__name__} cannot time its device "
                          "work apart: servelab-calibrate --host measures executor=model")
    plans: list = []
    schedule = engine.scheduler.schedule

    def scheduled() -> Any:
        plans.append(schedule())
        return plans[-1]

    engine.scheduler.schedule = scheduled
    return timer, plans


def measure(workload: Workload, scheduler: str = "chunked", allocator: str = "paged",
            seed: int = 0) -> list[dict[str, Any]]:  # fmt: skip
    """One row per recorded step: what it held (`host_profile.counts` of its shape, as
    the simulated executor reads it) and its host and device seconds."""
    from servelab.engine.build import build_engine

    engine = build_engine(engine_config(workload, scheduler, allocator))
    timer, plans = instrument(engine)
    rng = np.random.default_rng(seed)
    vocab = engine.executor.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=workload.outputs, ignore_eos=True)
    for _ in range(workload.requests):
        engine.add_request(rng.integers(3, vocab, workload.prompt).tolist(), params)
    rows = []
    while engine.has_unfinished():
        recorded = len(engine.metrics.steps)
        timer.cpu = timer.wall = 0.0
        c, w = time.thread_time(), time.perf_counter()
        outputs = engine.step()
        cpu, wall = time.thread_time() - c, time.perf_counter() - w
        if len(engine.metrics.steps) == recorded:
            continue  # nothing ran: not a step
        rows.append({
            "counts": counts(step_shape(plans[-1]), len(outputs)),
            "host_cpu_s": cpu - timer.cpu,
            "host_wall_s": wall - timer.wall,
            "device_s": timer.wall,
        })  # fmt: skip
    return rows


def measure_median(
    workload: Workload, repeats: int, scheduler: str = "chunked", allocator: str = "paged"
) -> list[dict[str, float]]:
    """`measure` run `repeats` times on the same requests (the same steps), each step's
    seconds the median of its repeats: a step another process slowed is one of them."""
    runs = [measure(workload, scheduler, allocator) for _ in range(repeats)]
    rows = runs[0]
    for i, row in enumerate(rows):
        for key in ("host_cpu_s", "host_wall_s", "device_s"):
            row[key] = float(np.median([run[i][key] for run in runs]))
    return rows


def fit(rows: list[dict[str, Any]], key: str = "host_cpu_s") -> tuple[np.ndarray, float]:
    """Non-negative least squares of `key` on the rows' counts (FIGURES' columns), each
    row weighed by 1/its seconds (relative errors: a 100 us step counts as much as a
    3 ms one); the figures and the median |predicted / measured - 1|."""
    from scipy.optimize import nnls

    x = np.array([r["counts"] for r in rows])
    y = np.array([r[key] for r in rows])
    weights = 1.0 / np.maximum(y, 1e-6)
    figures, _ = nnls(x * weights[:, None], y * weights)
    error = float(np.median(np.abs(x @ figures / y - 1)))
    return figures, error


def run_error(profile: HostProfile, rows: list[dict[str, float]]) -> tuple[float, float]:
    """A run's host seconds as the profile prices its steps, and as measured."""
    figures = np.array([getattr(profile, f) for f in FIGURES])
    priced = float(sum(np.dot(figures, r["counts"]) for r in rows))
    return priced, sum(r["host_cpu_s"] for r in rows)


def host_profile(name: str, rows: list[dict[str, Any]], commit: str) -> HostProfile:
    figures, error = fit(rows)
    wall, wall_error = fit(rows, "host_wall_s")
    values = {f: float(f"{v:.4g}") for f, v in zip(FIGURES, figures)}
    walls = ", ".join(f"{f} {v:.3g}" for f, v in zip(FIGURES, wall))
    return HostProfile(name, **values, sources={
        "measured": f"servelab-calibrate --host on {cpu_generation()}, servelab {commit}: the real "
                    f"engine's steps (executor=model, model tiny, attention flash_varlen, one "
                    f"torch thread), {len(rows)} steps of a grid of decode batches of 1-256 "
                    f"sequences and prompt chunks of up to 4,096 tokens, each step's seconds "
                    f"the median of its repeats; main-thread CPU seconds per step less the "
                    f"forward, LM head and argmax; median abs step error {error:.1%}",
        "wall": f"the same fitted to wall seconds: {walls} (median abs step error "
                f"{wall_error:.1%})",
    })  # fmt: skip


def write_host_profile(profile: HostProfile, out: Path) -> None:
    import yaml

    out.write_text(
        "# the engine's own CPU time per step on the machine named below (servelab.lab.host_time)\n"
        + yaml.safe_dump(profile.to_dict(), sort_keys=False, width=100)
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="servelab-calibrate --host",
                                     description=__doc__.split("\n\n")[0])  # fmt: skip
    parser.add_argument("--host", type=Path, required=True, help="the host profile to write")
    parser.add_argument("--name", help="its name (default: the file's stem)")
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="runs of each workload (a step's seconds: their median)",
    )
    parser.add_argument("--scheduler", default="chunked")
    parser.add_argument("--allocator", default="paged")
    args = parser.parse_args(argv)
    measure(GRID[0], args.scheduler, args.allocator)  # warm-up: imports, first allocations
    rows = [row for w in GRID for row in measure_median(w, args.repeats, args.scheduler,
                                                        args.allocator)]  # fmt: skip
    profile = host_profile(args.name or args.host.stem, rows, git_commit() or "unknown")
    write_host_profile(profile, args.host)
    print(f"{len(rows)} steps; wrote {args.host}")
    for key, value in profile.sources.items():
        print(f"  {key}: {value}")
    print("held-out runs: host seconds priced / measured (main-thread CPU)")
    for w in HELD_OUT:
        priced, measured = run_error(profile, measure_median(w, args.repeats, args.scheduler,
                                                             args.allocator))  # fmt: skip
        print(f"  {w}: {priced:.3f} / {measured:.3f} s, {priced / measured - 1:+.1%}")
    return 0
