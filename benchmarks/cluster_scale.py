"""The simulated cluster at scale: 64 replicas of Llama-3-8B on `h100-sxm`, least-load
routing, 20,000 Poisson-arriving requests (640/s). A benchmark, not a test: it composes the
config as `servelab` does (Hydra, the same overrides), runs `run_cluster` and prints the CPU
seconds (`time.process_time`, what one core spent: robust to a shared machine) and the wall
seconds it took, the replica steps and the finished requests. The goal is under 120 s of CPU.

    python benchmarks/cluster_scale.py                      # the full run
    python benchmarks/cluster_scale.py --replicas 8 --requests 2000 --rate 80   # a small one
    python benchmarks/cluster_scale.py --profile out.prof   # ... under cProfile
    python benchmarks/cluster_scale.py -- engine.max_num_seqs=128   # more overrides
"""

from __future__ import annotations

import argparse
import json
import time


def overrides(replicas: int, requests: int, rate: float, extra: list[str]) -> list[str]:
    return [
        "executor=simulated",
        "hardware=h100-sxm",
        "model=llama3-8b",
        "engine.gpu_memory_utilization=0.9",
        "engine.max_num_seqs=256",
        f"+cluster.replicas={replicas}",
        "+cluster.record_steps=false",
        "router=least_load",
        "workload=synthetic",
        f"workload.num_requests={requests}",
        "workload.arrival=poisson",
        f"workload.rate={rate}",
        *extra,
    ]


def compose(args: list[str]) -> dict:
    """The config `servelab ARGS` would run, as a plain dict."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    GlobalHydra.instance().clear()
    with initialize_config_module("servelab.conf", version_base="1.3"):
        return OmegaConf.to_container(hydra_compose("config", overrides=args), resolve=True)


def run(config: dict) -> dict:
    from servelab.lab.cluster.run import run_cluster

    cpu, wall = time.process_time(), time.perf_counter()
    result = run_cluster(config)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    summary = result.summary
    return {
        "cpu_s": round(cpu, 2),
        "wall_s": round(wall, 2),
        "replica_steps": int(summary["steps"]),
        "cpu_ms_per_step": round(1000 * cpu / max(summary["steps"], 1), 4),
        "finished": int(summary["requests"]),
        "requests": int(summary["requests_total"]),
        "output_tokens": int(summary["output_tokens"]),
        "ttft_p50_ms": summary["ttft_p50_ms"],
        "ttft_p99_ms": summary["ttft_p99_ms"],
        "load_imbalance": summary["load_imbalance"],
        "output_digest": summary["output_digest"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=64)
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--rate", type=float, default=640.0)
    parser.add_argument("--profile", help="write a cProfile of the run here")
    parser.add_argument("extra", nargs="*", help="more Hydra overrides")
    args = parser.parse_args()
    config = compose(overrides(args.replicas, args.requests, args.rate, args.extra))
    if args.profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
        figures = run(config)
        profiler.disable()
        profiler.dump_stats(args.profile)
    else:
        figures = run(config)
    print(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
