"""`servelab route`'s app: an OpenAI-compatible endpoint in front of N replicas.

Each completion or chat request is routed by the router part through the same `Dispatcher`
as the simulated cluster, then forwarded unchanged to the chosen replica's same path; a
stream is relayed event by event (the first event marks the request running in the ledger,
its end finished). What the router sees of a prompt: a completions prompt given as token
ids is those ids; text (a completions prompt or chat messages) is its characters' code
points, since the proxy holds no tokenizer (SGLang's router matches prefixes on text too).
`/metrics` exports the proxy's own figures (requests routed per replica, in flight,
failures, requests sent to a busy replica while another was idle, time to first byte); `/v1/models` and `/health` answer from the first replica.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from servelab.cluster.dispatch import Dispatcher
from servelab.contracts.router import RoutedRequest

DEFAULT_MAX_TOKENS = 16  # OpenAI's completions default, for the router's token count


class ProxyMetrics:
    def __init__(self, num_replicas: int) -> None:
        self.registry = r = CollectorRegistry()
        self.routed = Counter("servelab_route_requests", "requests routed", ["replica"], registry=r)
        self.in_flight = Gauge(
            "servelab_route_in_flight", "requests in flight", ["replica"], registry=r
        )
        self.failed = Counter("servelab_route_failures", "replica errors", ["replica"], registry=r)
        self.sent_to_busy = Counter(
            "servelab_route_sent_to_busy_while_idle",
            "requests sent to a replica with requests in flight while another had none",
            registry=r,
        )
        self.first_byte = Histogram("servelab_route_first_byte_seconds", "time to first byte",
                                    registry=r)  # fmt: skip
        for i in range(num_replicas):
            self.routed.labels(str(i))
            self.in_flight.labels(str(i))
            self.failed.labels(str(i))

    def text(self) -> bytes:
        return generate_latest(self.registry)


def routed_view(request_id: str, body: Mapping[str, Any], now: float) -> RoutedRequest:
    """What the router sees of one OpenAI request body."""
    prompt = body.get("prompt")
    if prompt is None:  # chat: the messages' roles and text, in order
        parts = []
        for message in body.get("messages") or []:
            content = message.get("content")
            if isinstance(content, list):
                content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
            parts.append(f"{message.get('role', '')}:{content or ''}\n")
        prompt = "".join(parts)
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        tokens = tuple(ord(c) for c in prompt)
    else:
        tokens = tuple(t for t in prompt if isinstance(t, int))
    max_tokens = body.get("max_tokens") or body.get("max_completion_tokens") or DEFAULT_MAX_TOKENS
    return RoutedRequest(request_id, tokens, int(max_tokens), now)


def create_proxy_app(
    dispatcher: Dispatcher,
    replicas: Sequence[str],
    clients: Sequence[httpx.AsyncClient] | None = None,
) -> FastAPI:
    """The app; `clients` (one per replica) default to plain HTTP clients of `replicas`' URLs."""
    clients = list(clients or [httpx.AsyncClient(base_url=u, timeout=None) for u in replicas])
    metrics = ProxyMetrics(len(clients))
    app = FastAPI(title="servelab route")
    app.state.dispatcher, app.state.metrics = dispatcher, metrics
    counter = iter(range(1 << 62))

    @app.get("/health")
    async def health():
        return {"status": "ok", "replicas": list(replicas)}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.text(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        reply = await clients[0].get("/v1/models")
        return JSONResponse(reply.json(), status_code=reply.status_code)

    async def forward(request: Request, path: str):
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError:
            return JSONResponse({"error": {"message": "the body is not JSON", "type": "invalid_request_error"}},
                                status_code=400)  # fmt: skip
        request_id = f"route-{next(counter)}"
        busy_before = dispatcher.sent_to_busy_while_idle
        index = dispatcher.dispatch(routed_view(request_id, body, time.monotonic()))
        if dispatcher.sent_to_busy_while_idle > busy_before:
            metrics.sent_to_busy.inc()
        label = str(index)
        metrics.routed.labels(label).inc()
        metrics.in_flight.labels(label).inc()
        headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        started = time.perf_counter()
        client = clients[index]
        try:
            upstream = await client.send(
                client.build_request(
                    "POST",
                    path,
                    content=raw,
                    headers={**headers, "content-type": "application/json"},
                ),
                stream=True,
            )
        except httpx.HTTPError as err:
            _done(request_id, label, failed=True)
            return JSONResponse({"error": {"message": f"replica {index} unreachable: {err}", "type": "server_error"}},
                                status_code=502)  # fmt: skip
        if not body.get("stream"):
            content = await upstream.aread()
            await upstream.aclose()
            metrics.first_byte.observe(time.perf_counter() - started)
            _done(request_id, label, failed=upstream.status_code >= 500)
            return Response(content, status_code=upstream.status_code,
                            media_type=upstream.headers.get("content-type"))  # fmt: skip

        async def relay():
            first = True
            try:
                async for chunk in upstream.aiter_raw():
                    if first:
                        first = False
                        metrics.first_byte.observe(time.perf_counter() - started)
                        dispatcher.started(request_id)
                    yield chunk
            finally:
                await upstream.aclose()
                _done(request_id, label, failed=upstream.status_code >= 500)

        return StreamingResponse(relay(), status_code=upstream.status_code,
                                 media_type=upstream.headers.get("content-type", "text/event-stream"))  # fmt: skip

    def _done(request_id: str, label: str, failed: bool) -> None:
        dispatcher.finished(request_id)
        metrics.in_flight.labels(label).dec()
        if failed:
            metrics.failed.labels(label).inc()

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await forward(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await forward(request, "/v1/chat/completions")

    return app
