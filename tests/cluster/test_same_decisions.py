"""The same arrival sequence and the same replica states give the same routing decisions in
a simulated cluster and in `servelab route` in front of real `servelab serve` replicas.

Both read the replicas' states from one scripted feed (a deterministic function of the
arrival's position, the same in both), so any difference is the routing path's. The real
side sends each request through the proxy app to live HTTP replicas, in arrival order."""

from __future__ import annotations

import asyncio
import zlib

import httpx
import pytest

from servelab.cluster.dispatch import Dispatcher
from servelab.cluster.proxy import create_proxy_app
from servelab.contracts.router import ReplicaState, RoutedRequest
from servelab.lab.arrivals import ArrivalQueue
from servelab.lab.cluster.run import run_cluster
from servelab.lab.workload import make_workload
from servelab.registry.construct import construct
from tests.serve.harness import Running, free_port, server_config

REPLICAS = 3
WORKLOAD = {"name": "synthetic", "num_requests": 24, "prompt_len": {"dist": "uniform", "mean": 24,
            "std": 0, "min": 8, "max": 40}, "output_len": {"dist": "fixed", "mean": 3, "std": 0,
            "min": 3, "max": 3}, "shared_prefix_len": 32, "shared_fraction": 0.5, "seed": 3,
            "arrival": "poisson", "rate": 50.0}  # fmt: skip
ROUTERS = [
    "round_robin",
    "least_load",
    {"name": "power_of_two", "seed": 5},
    {"name": "prefix_affinity", "block_size": 8, "balance_abs_tokens": 300},
]


class ScriptedFeed:
    """Replica states as a fixed function of how many requests were routed before."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, request: RoutedRequest) -> list[ReplicaState]:
        n, self.calls = self.calls, self.calls + 1
        load = [zlib.crc32(f"{n}:{i}".encode()) % 500 for i in range(REPLICAS)]
        return [ReplicaState(i, running_requests=load[i] // 100, running_tokens=load[i])
                for i in range(REPLICAS)]  # fmt: skip


def simulated_decisions(router) -> list[int]:
    config = {"model": "tiny", "executor": "simulated", "router": router,
              "cluster": {"replicas": REPLICAS}, "workload": WORKLOAD,
              "engine": {"max_model_len": 128, "kv_cache_memory": "1MiB"}}  # fmt: skip
    return [replica for _, replica in run_cluster(config, feed=ScriptedFeed()).decisions]


async def _send_all(app, prompts: list[list[int]]) -> list[int]:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://route") as client:
        for prompt in prompts:  # in arrival order, one at a time: the order is the sequence
            reply = await client.post("/v1/completions", json={
                "model": "tiny", "prompt": prompt, "max_tokens": 3, "temperature": 0,
                "ignore_eos": True, "stream": True})  # fmt: skip
            assert reply.status_code == 200, reply.text
            assert "[DONE]" in reply.text
    return [replica for _, replica in app.state.dispatcher.decisions]


@pytest.fixture(scope="module")
def replicas():
    config = server_config("tiny", engine={"cpu_kernels": "off"})  # no C++ build: a tiny model
    servers = [Running({**config, "serve": {**config["serve"], "port": free_port()}})
               for _ in range(REPLICAS)]  # fmt: skip
    started = [s.__enter__() for s in servers]
    yield [s.url for s in started]
    for s in servers:
        s.__exit__(None, None, None)


@pytest.mark.parametrize("router", ROUTERS, ids=lambda r: r if isinstance(r, str) else r["name"])
def test_simulated_and_real_cluster_route_alike(router, replicas):
    requests = make_workload(WORKLOAD, vocab_size=256, max_model_len=128)
    arrivals = ArrivalQueue(requests)
    ordered = arrivals.pop_due(float("inf"))
    simulated = simulated_decisions(router)
    dispatcher = Dispatcher(
        construct("router", router, num_replicas=REPLICAS), REPLICAS, ScriptedFeed()
    )
    app = create_proxy_app(dispatcher, replicas)
    real = asyncio.run(_send_all(app, [r.prompt_token_ids for r in ordered]))
    assert len(simulated) == len(real) == WORKLOAD["num_requests"]
    assert real == simulated
    assert len(set(real)) > 1  # the feed spreads them: the comparison is not trivially all-zero
