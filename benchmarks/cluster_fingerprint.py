"""Fingerprints of simulated runs, to show a change of the simulated path changes no result.

Each case composes a config as `servelab` does (the overrides of `cluster_scale.py`, at 8
replicas x 2,000 requests by default, over routers, schedulers, allocators, preemption and
a prefill/decode split; one case is a single Llama-3-70B TP8 engine as in
`simulate_scale.py`, at fewer requests) and prints, per case, sha256 prefixes of the whole
summary, of every request's `csv_row`, of every step record, of the placement and the
router's decisions and of every request's tokens. The virtual clock makes them exact: run
this before and after a change and diff the two outputs, which must be equal line for line.

    python benchmarks/cluster_fingerprint.py > before.txt     # on the old code
    python benchmarks/cluster_fingerprint.py > after.txt      # on the new code
    diff before.txt after.txt
    python benchmarks/cluster_fingerprint.py --replicas 4 --requests 500 --case least_load
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time

from cluster_scale import compose, overrides
from simulate_scale import CONFIG as SINGLE_70B  # run here at `--requests` requests

# extra overrides per case, on top of cluster_scale's (least-load, continuous, paged)
CASES: dict[str, list[str]] = {
    "least_load": [],
    "round_robin-chunked": ["router=round_robin", "scheduler=chunked", "scheduler.chunk_size=256"],
    "power_of_two-vtc": ["router=power_of_two", "scheduler=vtc", "engine.max_num_seqs=8"],
    "prefix_affinity-prefix_caching": [
        "router=prefix_affinity",
        "allocator.prefix_caching=true",
        "workload.shared_prefix_len=256",
        "workload.shared_fraction=0.5",
    ],
    "least_load-mlfq": ["scheduler=mlfq", "engine.max_num_seqs=8"],
    "round_robin-static": ["router=round_robin", "scheduler=static"],
    "least_load-radix-lpm": ["allocator=radix", "scheduler.order=lpm",
                             "workload.shared_prefix_len=128", "workload.shared_fraction=0.8"],
    "tight-recompute": ["engine.gpu_memory_utilization=null", "engine.kv_cache_memory=1GiB",
                        "engine.max_num_seqs=64"],
    "tight-swap-chunked": ["engine.gpu_memory_utilization=null", "engine.kv_cache_memory=1GiB",
                           "engine.swap_space=512MiB", "preemption=swap", "scheduler=chunked"],
    "padded-tp2": ["attention=padded", "engine.tensor_parallel_size=2"],
    "speculative": ["proposer=simulated"],
    "disaggregated-pd_1_3": ["cluster=pd_1_3"],
}  # fmt: skip


def sha(value) -> str:
    text = json.dumps(value, sort_keys=True, default=repr)  # floats as repr: every bit
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def fingerprint(result) -> dict[str, str]:
    summary = result.summary
    headline = {k: summary.get(k) for k in ("steps", "requests", "preemptions", "output_tok_s")}
    print(f"  {headline}", file=sys.stderr)
    figures = {
        "summary": sha(result.summary),
        "requests": sha([r.csv_row() for r in result.requests]),
        "steps": sha([s.row() for s in result.steps]),
        "tokens": sha(getattr(result, "tokens", None) or getattr(result, "outputs", None)),
    }
    for name in ("placement", "decisions", "columns"):
        if hasattr(result, name):
            figures[name] = sha(getattr(result, name))
    return figures


def run_case(name: str, replicas: int, requests: int, rate: float) -> dict:
    if name == "single-70b-tp8":
        from servelab.lab.runner import run_config

        config = {**SINGLE_70B, "workload": {**SINGLE_70B["workload"], "num_requests": requests}}
        return fingerprint(run_config(config))
    from servelab.lab.cluster.run import run_cluster

    extra = ["+cluster.record_steps=true" if o == "+cluster.record_steps=false" else o
             for o in overrides(replicas, requests, rate, CASES[name])]  # fmt: skip
    if name.startswith("disaggregated"):  # the cluster group names the shape: no +cluster.replicas
        extra = [o for o in extra if not o.startswith("+cluster.")]
    return fingerprint(run_cluster(compose(extra)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--rate", type=float, default=80.0)
    parser.add_argument("--case", action="append", help="only these cases (repeatable)")
    args = parser.parse_args()
    for name in args.case or [*CASES, "single-70b-tp8"]:
        begin = time.perf_counter()
        requests = args.requests // 2 if name == "single-70b-tp8" else args.requests
        figures = run_case(name, args.replicas, requests, args.rate)
        seconds = time.perf_counter() - begin
        print(name, " ".join(f"{k}={v}" for k, v in figures.items()), flush=True)
        print(f"  {name}: {seconds:.1f} s", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
