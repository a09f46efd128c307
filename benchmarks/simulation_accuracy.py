"""How well the simulated executor predicts the real engine on this machine.

1. Calibrate: `servelab-calibrate`'s grid (all-at-once decode batches x prompt
   lengths, prompt chunks next to decodes) through the real engine, fitted into a
   `cpu-local` profile.
2. Predict held-out workloads the fit never saw (other seeds and lengths, Poisson
   arrivals at several rates, every scheduler, paged and contiguous, both
   preemptions under a tight KV budget): each one is served by the real engine and
   by `executor=simulated` with the fitted profile, same configuration otherwise.
3. Print predicted vs measured total time, TTFT p50 / p99 and TPOT p50 per
   workload, and the median absolute error of each over the workloads.

Everything runs in this process pinned to one core with one torch thread, so the
profile describes exactly what is measured.

    python benchmarks/simulation_accuracy.py --cpu 1 --out accuracy/
    (SERVELAB_BENCH_SMOKE=1: two small workloads, a quick check that it runs)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

from servelab.executor.hardware import load_profile
from servelab.lab.calibrate import fit_profile, measure, median_abs_error, predict, write_profile
from servelab.lab.runner import run_config

FIGURES = {  # summary key -> column title
    "wall_time_s": "total s",
    "ttft_p50_ms": "TTFT p50 ms",
    "ttft_p99_ms": "TTFT p99 ms",
    "tpot_p50_ms": "TPOT p50 ms",
}
ROOMY, TIGHT = "64MiB", "2MiB"  # 2 MiB holds 512 tokens of `bench` (4 KiB a token)


def workload(seed: int, n: int, prompt: tuple[int, int], output: tuple[int, int], rate) -> dict:
    arrival = {"arrival": "poisson", "rate": rate} if rate else {"arrival": "all_at_once"}
    return {
        "name": "synthetic",
        "num_requests": n,
        "prompt_len": {
            "dist": "uniform",
            "mean": sum(prompt) / 2,
            "min": prompt[0],
            "max": prompt[1],
        },
        "output_len": {
            "dist": "uniform",
            "mean": sum(output) / 2,
            "min": output[0],
            "max": output[1],
        },
        "seed": seed,
        "ignore_eos": True,
        **arrival,
    }


# name, scheduler, allocator, preemption, KV budget, workload; none of it is in the fit
HELD_OUT = [
    ("continuous-paged-r4", {"name": "continuous"}, "paged", "recompute", ROOMY,
     workload(11, 48, (32, 256), (16, 192), 4.0)),
    ("continuous-paged-r12", {"name": "continuous"}, "paged", "recompute", ROOMY,
     workload(12, 48, (32, 256), (16, 192), 12.0)),
    ("continuous-contiguous-r8", {"name": "continuous"}, "contiguous", "recompute", ROOMY,
     workload(13, 48, (64, 320), (32, 160), 8.0)),
    ("static-paged-once", {"name": "static"}, "paged", "recompute", ROOMY,
     workload(14, 32, (32, 256), (16, 128), None)),
    ("static-contiguous-r16", {"name": "static"}, "contiguous", "recompute", ROOMY,
     workload(15, 40, (32, 192), (16, 128), 16.0)),
    ("chunked64-paged-r6", {"name": "chunked", "chunk_size": 64}, "paged", "recompute", ROOMY,
     workload(16, 40, (128, 480), (16, 128), 6.0)),
    ("chunked128-contiguous-once", {"name": "chunked", "chunk_size": 128}, "contiguous",
     "recompute", ROOMY, workload(17, 32, (64, 400), (16, 160), None)),
    ("continuous-paged-swap-tight", {"name": "continuous"}, "paged", "swap", TIGHT,
     workload(18, 32, (32, 96), (32, 128), None)),
    ("continuous-paged-recompute-tight", {"name": "continuous"}, "paged", "recompute", TIGHT,
     workload(19, 32, (32, 96), (32, 128), 10.0)),
    ("mlfq-paged-r8", {"name": "mlfq"}, "paged", "recompute", ROOMY,
     workload(20, 40, (32, 256), (16, 256), 8.0)),
    ("vtc-paged-r10", {"name": "vtc"}, "paged", "swap", ROOMY,
     workload(21, 40, (32, 256), (16, 192), 10.0)),
    ("continuous-radix-r6", {"name": "continuous"}, "radix", "recompute", ROOMY,
     workload(22, 40, (32, 256), (16, 192), 6.0)),
]  # fmt: skip


def config(scheduler, allocator, preemption, kv, work, threads: int) -> dict:
    return {
        "model": "bench",
        "scheduler": scheduler,
        "allocator": {"name": allocator},
        "preemption": preemption,
        "engine": {
            "dtype": "float32",
            "num_threads": threads,
            "kv_cache_memory": kv,
            "swap_space": "64MiB",
            # a tight budget must still hold one whole sequence
            "max_model_len": 256 if kv == TIGHT else 1024,
        },
        "workload": work,
        "run": {"progress": False, "warmup": True},
    }


def calibrate(out: Path, threads: int, repeats: int) -> Path:
    data = measure("bench", "float32", repeats, threads)
    fitted = fit_profile(
        load_profile("cpu-local"), data["shape"], data["shapes"], data["seconds"], "float32", 4
    )
    measured = np.array(data["seconds"])
    error = median_abs_error(predict(fitted, data["shape"], data["shapes"], "float32", 4), measured)
    path = out / "cpu-local-fitted.yaml"
    write_profile(fitted, path, f"{len(measured)} calibration steps, {threads} thread(s), "
                  f"median abs step error {error:.1%}")  # fmt: skip
    print(f"calibrated on {len(measured)} steps: median abs step error {error:.1%} -> {path}")
    return path


def compare(cases, profile: Path, threads: int, repeats: int) -> list[dict]:
    """Each case served `repeats` times for real (its measured figure: their median,
    as a step of this CPU's time wobbles by a third between runs) and once simulated."""
    rows = []
    for name, scheduler, allocator, preemption, kv, work in cases:
        cfg = config(scheduler, allocator, preemption, kv, work, threads)
        reals = [run_config(cfg).summary for _ in range(repeats)]
        real = reals[0]
        sim = run_config({**cfg, "executor": "simulated", "hardware": str(profile)}).summary
        row = {"workload": name, "preemptions": real["preemptions"]}
        for key in FIGURES:
            measured = [r[key] for r in reals]
            row[key] = {"measured": float(np.median(measured)), "predicted": sim[key],
                        "runs": measured}  # fmt: skip
        # the simulator must have made the run the real engine made
        row["same_tokens_out"] = real["output_tokens"] == sim["output_tokens"]
        rows.append(row)
        print(name, {k: f"{v['predicted']:.4g}/{v['measured']:.4g}" for k, v in row.items()
                     if isinstance(v, dict)}, flush=True)  # fmt: skip
    return rows


def error(cell: dict) -> float:
    return abs(cell["predicted"] / cell["measured"] - 1.0)


def markdown(rows: list[dict]) -> str:
    head = "| workload | " + " | ".join(f"{t} (pred / meas, err)" for t in FIGURES.values())
    lines = [head + " |", "|---" * (len(FIGURES) + 1) + "|"]
    for row in rows:
        cells = [f"{row[k]['predicted']:.3g} / {row[k]['measured']:.3g}, {error(row[k]):.1%}"
                 for k in FIGURES]  # fmt: skip
        lines.append(f"| {row['workload']} | " + " | ".join(cells) + " |")
    medians = [f"**{np.median([error(r[k]) for r in rows]):.1%}**" for k in FIGURES]
    lines.append("| median abs error | " + " | ".join(medians) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", type=int, help="pin this process to this core")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2, help="calibration grid repeats")
    parser.add_argument("--real-repeats", type=int, default=3, help="real runs per workload")
    parser.add_argument("--profile", type=Path, help="skip calibration: use this profile")
    parser.add_argument("--out", type=Path, default=Path("simulation-accuracy"))
    parser.add_argument("--only", help="run only the workloads whose name contains this")
    args = parser.parse_args(argv)
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    args.out.mkdir(parents=True, exist_ok=True)
    smoke = os.environ.get("SERVELAB_BENCH_SMOKE") == "1"
    cases = HELD_OUT
    if smoke:  # two short workloads
        cases = [(n, s, a, p, kv, {**w, "num_requests": 4}) for n, s, a, p, kv, w in HELD_OUT[3:5]]
    if args.only:
        cases = [c for c in cases if args.only in c[0]]
    profile = args.profile or calibrate(args.out, args.threads, 1 if smoke else args.repeats)
    rows = compare(cases, profile, args.threads, 1 if smoke else args.real_repeats)
    (args.out / "accuracy.json").write_text(json.dumps(rows, indent=1))
    table = markdown(rows)
    (args.out / "accuracy.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
