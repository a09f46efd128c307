"""A real multi-node Ray cluster on this machine (`ray.cluster_utils.Cluster`, one CPU per
node), replicas of the tiny text model as Ray actors, and `servelab route`'s proxy app
served by uvicorn on a thread, for the Ray tests. Everything started here is stopped by
its context manager: no Ray process outlives a test module."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx

from servelab.cluster.dispatch import Dispatcher
from servelab.cluster.proxy import create_proxy_app
from servelab.cluster.ray_replicas import local_cluster
from servelab.registry.construct import construct
from tests.serve.harness import free_port

ray_cluster = local_cluster  # a head and workers on this machine, joined by the test process


class RunningProxy:
    """`with RunningProxy(clients, router, ...) as proxy:` the proxy app on a free port."""

    def __init__(self, clients, router="round_robin", retries=1, health_interval=0.5) -> None:
        num = len(clients)
        self.dispatcher = Dispatcher(construct("router", router, num_replicas=num), num)
        names = [f"replica-{i}" for i in range(num)]
        self.app = create_proxy_app(self.dispatcher, names, clients, retries=retries,
                                    health_interval=health_interval)  # fmt: skip
        self.url = f"http://127.0.0.1:{free_port()}"

    def __enter__(self) -> RunningProxy:
        import uvicorn

        port = int(self.url.rsplit(":", 1)[1])
        config = uvicorn.Config(self.app, host="127.0.0.1", port=port, log_level="warning",
                                lifespan="off")  # fmt: skip
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "proxy did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=10).text


async def stream_completion(client: httpx.AsyncClient, body: dict, started=None) -> dict:
    """A streamed completion's token ids, text and error (None if it ended well); calls
    `started()` when its first token arrives. A request refused before its stream began
    (its replica unreachable, retries off: a 502) is an error status with a JSON body."""
    tokens: list[int] = []
    text, error, done = "", None, False
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        if r.status_code != 200:
            return {
                "tokens": [],
                "text": "",
                "error": json.loads(await r.aread())["error"]["message"],
            }
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            event = json.loads(line[6:])
            if "error" in event:
                error = event["error"]["message"]
                continue
            for choice in event["choices"]:
                if not tokens and started is not None and choice.get("token_ids"):
                    started()
                tokens += choice.get("token_ids") or []
                text += choice.get("text") or ""
    assert done, "the stream did not end with [DONE]"
    return {"tokens": tokens, "text": text, "error": error}


def gather(coroutines) -> list:
    async def go():
        return await asyncio.gather(*coroutines)

    return asyncio.run(go())
