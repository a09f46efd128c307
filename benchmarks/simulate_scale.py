"""The simulator at scale: 10,000 Poisson-arriving requests of Llama-3-70B with
tensor parallelism 8 on the `h100-sxm` profile, through the real continuous
scheduler, paged allocator and recompute preemption. A benchmark, not a test:
it prints the real seconds the simulation took (the goal is under 60 s on one
core) and writes the run's results, requests.csv and steps.csv; pass a folder
to also get servelab-report's plots.

    python benchmarks/simulate_scale.py [out_dir] [--hardware PROFILE]

(`--hardware h100-sxm-fa3`: the same run on the profile with FlashAttention 3's attention,
whose packed, split and unified calls take the cost model's other paths.)
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from servelab.lab.runner import print_summary, run_config, save_run

CONFIG = {
    "model": "llama3-70b",
    "executor": "simulated",
    "hardware": "h100-sxm",
    "scheduler": {"name": "continuous"},
    "allocator": {"name": "paged", "block_size": 16},
    "preemption": "recompute",
    "engine": {
        "dtype": "bfloat16",
        "tensor_parallel_size": 8,
        "gpu_memory_utilization": 0.9,
        "max_model_len": 8192,
        "max_num_seqs": 256,
        "max_num_batched_tokens": 8192,
    },
    "workload": {
        "name": "synthetic",
        "num_requests": 10_000,
        "arrival": "poisson",
        "rate": 12.0,
        "prompt_len": {"dist": "lognormal", "mean": 1024, "std": 768, "min": 16, "max": 6144},
        "output_len": {"dist": "lognormal", "mean": 256, "std": 192, "min": 8, "max": 2048},
        "seed": 0,
    },
    "run": {"progress": False, "warmup": False},
}


def main(out_dir: str | None = None, hardware: str = "h100-sxm") -> float:
    config = {**CONFIG, "hardware": hardware}
    begin, cpu = time.perf_counter(), time.process_time()
    result = run_config(config)
    seconds, cpu = time.perf_counter() - begin, time.process_time() - cpu
    summary = result.summary
    print_summary(summary, title=f"llama3-70b TP8 {hardware}, 10,000 requests: {seconds:.1f} s real")
    print(f"simulated {summary['wall_time_s']:.0f} s of serving in {seconds:.1f} s ({cpu:.1f} s of CPU)")
    if out_dir:
        folder = Path(out_dir)
        save_run(folder, result, config, {"real_seconds": seconds})
        from servelab.cli import report_main

        try:
            report_main([str(folder)])
        except SystemExit:
            pass
    return seconds


if __name__ == "__main__":
    args = sys.argv[1:]
    profile = "h100-sxm"
    if "--hardware" in args:
        i = args.index("--hardware")
        profile = args[i + 1]
        del args[i : i + 2]
    main(args[0] if args else None, profile)
