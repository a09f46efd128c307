"""Which way should a prefilled request's K/V cross between Ray actors? The same workload
through a real prefill/decode pair three ways: two local processes (torch.distributed,
gloo), two Ray actors on a two-node Ray cluster on this machine joined by a torch.distributed
group (`kv_transport=torch`), and the same actors handing the K/V through Ray's object store
(`kv_transport=object_store`).

    python benchmarks/pd_ray_transports.py [--repeats 3] [--requests 16] [--prompt-len 512]

The model is benchmarks/ray_route.py's random Qwen3 (4 layers, 2 KV heads of 64, float32:
4 KiB of K/V a token); every request has a `--prompt-len` prompt and 16 output tokens, all
arriving at once. Per way, over repeats (the ways' order rotating by repeat): the handoff
time (a request's first token on the prefill side to its admission on the decode side), the
K/V megabytes a handoff carries, the pair's wall time, each a mean with its 95% t interval.
"""

from __future__ import annotations

import argparse
import random

from ray_route import model_folder

from servelab.cluster.ray_replicas import local_cluster
from servelab.lab.cluster.pd_processes import run_pair
from servelab.lab.cluster.pd_ray import run_pair_ray
from servelab.lab.provenance import cpu_model
from servelab.lab.request_builder import WorkloadRequest
from servelab.lab.stats import interval_text, mean_estimate
from servelab.step.sequence import SamplingParams

WAYS = ("processes", "ray_torch", "ray_object_store")


def requests(count: int, prompt_len: int) -> list[WorkloadRequest]:
    rng = random.Random(0)
    params = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.0)
    return [WorkloadRequest([rng.randrange(10, 4000) for _ in range(prompt_len)], params,
                            request_id=f"r{i}") for i in range(count)]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=512)
    args = parser.parse_args()
    config = {"model": {"path": str(model_folder())}, "allocator": {"name": "paged"},
              "engine": {"dtype": "float32", "max_model_len": 2048, "num_threads": 1}}  # fmt: skip
    work = requests(args.requests, args.prompt_len)
    figures: dict[str, dict[str, list[float]]] = {w: {"handoff_ms": [], "wall_s": [], "mb": []} for w in WAYS}
    with local_cluster(nodes=2, cpus_per_node=1):
        for repeat in range(args.repeats):
            for way in WAYS[repeat % 3:] + WAYS[: repeat % 3]:
                if way == "processes":
                    import time

                    start = time.perf_counter()
                    result = run_pair(config, work)
                    wall = time.perf_counter() - start
                else:
                    result = run_pair_ray(config, work, kv_transport=way.removeprefix("ray_"))
                    wall = result.decode["wall_s"]
                handoffs = result.decode["handoff_s"]
                figures[way]["handoff_ms"].append(1e3 * sum(handoffs) / len(handoffs))
                figures[way]["wall_s"].append(wall)
                figures[way]["mb"].append(result.prefill["kv_bytes"] / result.prefill["sent"] / 2**20)
                print(f"repeat {repeat} {way:17} handoff {figures[way]['handoff_ms'][-1]:.2f} ms, "
                      f"wall {wall:.2f} s", flush=True)  # fmt: skip
    print(f"CPU: {cpu_model()}; {args.requests} requests x {args.prompt_len} prompt tokens, "
          f"{args.repeats} repeats")  # fmt: skip
    for way in WAYS:
        parts = []
        for name, values in figures[way].items():
            estimate = mean_estimate(values)
            parts.append(f"{name} {estimate.mean:.3g} {interval_text(estimate)}")
        print(f"{way:17} " + ", ".join(parts))


if __name__ == "__main__":
    main()
