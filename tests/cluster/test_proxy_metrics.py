"""`servelab route`'s /metrics: every metric docs/cluster.md names is exported under that
name, and the counts are the requests routed. Replicas are stand-ins (httpx's mock
transport), so no server starts."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import httpx

from servelab.cluster.dispatch import Dispatcher
from servelab.cluster.proxy import create_proxy_app
from servelab.registry.construct import construct

DOC = Path(__file__).resolve().parents[2] / "docs" / "cluster.md"


def replica(index: int) -> httpx.AsyncClient:
    def reply(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"id": f"r{index}", "choices": [{"text": "ok"}]})

    return httpx.AsyncClient(transport=httpx.MockTransport(reply), base_url=f"http://r{index}")


def serve(router, prompts: list[str]) -> tuple[str, Dispatcher]:
    dispatcher = Dispatcher(construct("router", router, num_replicas=3), 3)
    app = create_proxy_app(dispatcher, ["http://r0", "http://r1", "http://r2"],
                           clients=[replica(i) for i in range(3)])  # fmt: skip

    async def go() -> str:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://route") as client:
            for prompt in prompts:  # one at a time: each finished before the next arrives
                reply = await client.post("/v1/completions", json={"prompt": prompt})
                assert reply.status_code == 200, reply.text
            return (await client.get("/metrics")).text

    return asyncio.run(go()), dispatcher


def sample(text: str, name: str, replica: str | None = None) -> float:
    label = f'{{replica="{replica}"}}' if replica is not None else ""
    match = re.search(rf"^{re.escape(name + label)} (\S+)$", text, re.M)
    assert match, f"{name}{label} not in /metrics"
    return float(match.group(1))


def test_every_metric_the_guide_names_is_exported():
    text, _ = serve("round_robin", ["a", "b", "c", "d"])
    named = set(re.findall(r"`(servelab_route_\w+)", DOC.read_text()))
    assert {"servelab_route_requests_total", "servelab_route_in_flight"} <= named
    samples = {line.split("{")[0].split(" ")[0] for line in text.splitlines()
               if line and not line.startswith("#")}  # fmt: skip
    families = set(re.findall(r"^# TYPE (\S+) ", text, re.M))  # a histogram's own name
    exported = samples | families
    assert named <= exported, named - exported
    assert [sample(text, "servelab_route_requests_total", str(i)) for i in range(3)] == [2, 1, 1]
    assert sample(text, "servelab_route_sent_to_busy_while_idle_total") == 0


def test_sequential_requests_sharing_a_prefix_stay_on_one_idle_replica():
    """One request at a time: every replica is idle at each arrival, so the replica holding
    the shared prefix serves each without anyone waiting (the cache hit costs nothing)."""
    system = "You are a helpful assistant. Answer in one short sentence. " * 2
    prompts = [system + question for question in ("Hi?", "Why?", "How?", "When?")]
    text, dispatcher = serve("prefix_affinity", prompts)
    assert [replica for _, replica in dispatcher.decisions] == [0, 0, 0, 0]
    assert sample(text, "servelab_route_requests_total", "0") == 4
    assert dispatcher.sent_to_busy_while_idle == 0
