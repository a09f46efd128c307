"""What a replica's death costs the requests that survive it: two Ray replicas behind the
proxy, one killed a third of the way through a streamed workload, against one replica
serving the same workload from the start (the capacity left after the death).

    python benchmarks/ray_failover.py [--repeats 3] [--requests 96] [--concurrency 16]

benchmarks/ray_route.py's random Qwen3 (float32), one CPU per replica on a two-node Ray
cluster on this machine; greedy requests of 64-token prompts and 48 output tokens, at most
`--concurrency` in flight, streamed through `servelab.cluster.proxy` (retries on). Per run:
every request's tokens are checked against a run with no death (they must be equal), and the
mean inter-token time of the requests that started after the death (served by the survivor
alone, beside the resubmitted ones) is compared with the single replica's mean inter-token
time over the same concurrency. A ratio near 1 means the survivors run as fast as the capacity
left allows; above 1, the death cost them more than the lost replica (the resubmitted
requests' repeated prefills are part of that cost). Means over repeats with 95% t intervals,
the two runs alternating by repeat.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import threading
import time

import httpx
from ray_route import model_folder

from servelab.cluster.dispatch import Dispatcher
from servelab.cluster.proxy import create_proxy_app
from servelab.cluster.ray_replicas import RayPlacement, RayReplicas, local_cluster
from servelab.lab.provenance import cpu_model
from servelab.lab.stats import interval_text, mean_estimate, ratio_estimate
from servelab.registry.construct import construct

CONFIG = {"engine": {"dtype": "float32", "max_model_len": 1024, "num_threads": 1},
          "serve": {"log_level": "warning"}}  # fmt: skip


def bodies(name: str, count: int) -> list[dict]:
    rng = random.Random(0)
    return [{"model": name, "prompt": [rng.randrange(10, 4000) for _ in range(64)],
             "max_tokens": 48, "ignore_eos": True, "temperature": 0, "stream": True}
            for _ in range(count)]  # fmt: skip


async def one(client: httpx.AsyncClient, body: dict) -> dict:
    started = time.perf_counter()
    tokens, times = [], []
    async with client.stream("POST", "/v1/completions", json=body) as reply:
        async for line in reply.aiter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                for choice in event.get("choices", []):
                    new = choice.get("token_ids") or []
                    tokens += new
                    times += [time.perf_counter()] * len(new)
    return {"started": started, "tokens": tokens, "times": times}


def serve(
    replicas: RayReplicas, requests: list[dict], concurrency: int, kill_after: int | None
) -> tuple[list[dict], float | None]:
    """Streams the requests through a proxy app in this process; kills replica 1's process
    once `kill_after` requests have finished. Returns the streams and the death's time."""
    clients = [httpx.AsyncClient(transport=t, base_url="http://replica", timeout=None)
               for t in replicas.transports()]  # fmt: skip
    dispatcher = Dispatcher(
        construct("router", "round_robin", num_replicas=len(clients)), len(clients)
    )
    app = create_proxy_app(dispatcher, replicas.names, clients, retries=1, health_interval=0.5)
    death: list[float] = []
    pid = None
    if kill_after is not None:
        import ray

        pid = ray.get(replicas.actors[1].where.remote())[0]

    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="off"))  # fmt: skip
    thread = threading.Thread(target=server.run, daemon=True)  # the proxy streams for real
    thread.start()
    while not server.started:
        time.sleep(0.05)

    async def go():
        gate = asyncio.Semaphore(concurrency)
        done = 0
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600) as client:

            async def limited(body):
                nonlocal done
                async with gate:
                    result = await one(client, body)
                done += 1
                if kill_after is not None and done == kill_after:
                    os.kill(pid, signal.SIGKILL)
                    death.append(time.perf_counter())
                return result

            return await asyncio.gather(*(limited(b) for b in requests))

    try:
        return asyncio.run(go()), (death[0] if death else None)
    finally:
        server.should_exit = True
        thread.join(30)


def itl(results: list[dict], after: float | None = None) -> float:
    gaps = []
    for r in results:
        if after is not None and r["started"] < after:
            continue
        gaps += [b - a for a, b in zip(r["times"], r["times"][1:])]
    return sum(gaps) / len(gaps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()
    folder = model_folder()
    config = {**CONFIG, "model": {"path": str(folder)}}
    requests = bodies(folder.name, args.requests)
    survivors, alone, reference = [], [], None
    with local_cluster(nodes=2, cpus_per_node=1):
        for repeat in range(args.repeats):
            for run in ("death", "alone") if repeat % 2 == 0 else ("alone", "death"):
                count = 2 if run == "death" else 1
                replicas = RayReplicas(count, config, placement=RayPlacement(num_cpus=1))
                replicas.wait_ready(300)
                try:
                    kill = args.requests // 3 if run == "death" else None
                    results, death = serve(replicas, requests, args.concurrency, kill)
                finally:
                    replicas.stop()
                tokens = [r["tokens"] for r in results]
                reference = reference or tokens
                assert tokens == reference, "a request's tokens changed"
                if run == "death":
                    survivors.append(itl(results, after=death))
                else:
                    alone.append(itl(results))
                print(f"repeat {repeat} {run:5}: mean ITL {1e3 * (survivors if run == 'death' else alone)[-1]:.2f} ms",
                      flush=True)  # fmt: skip
    s, a = mean_estimate([1e3 * x for x in survivors]), mean_estimate([1e3 * x for x in alone])
    ratio = ratio_estimate(survivors, alone, paired=True)
    print(
        f"CPU: {cpu_model()}; {args.requests} requests, concurrency {args.concurrency}, {args.repeats} repeats"
    )
    print(f"after the death, mean ITL {s.mean:.2f} ms {interval_text(s)}; one replica alone {a.mean:.2f} ms "
          f"{interval_text(a)}; ratio {ratio.mean:.3f} {interval_text(ratio)}")  # fmt: skip


if __name__ == "__main__":
    main()
