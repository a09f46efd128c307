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

import asyncio
import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from servelab.cluster.dispatch import Dispatcher, NoLiveReplica
from servelab.cluster.resume import StreamLedger, resumable
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
        self.up = Gauge("servelab_route_replica_up", "1 while the replica answers, 0 while down",
                        ["replica"], registry=r)  # fmt: skip
        self.marked_down = Counter("servelab_route_replica_down", "times the replica was found dead",
                                   ["replica"], registry=r)  # fmt: skip
        self.resubmitted = Counter(
            "servelab_route_resubmitted",
            "requests resubmitted to another replica after this one failed",
            ["replica"],
            registry=r,
        )
        for i in range(num_replicas):
            for family in (self.routed, self.in_flight, self.failed, self.up, self.marked_down,
                           self.resubmitted):  # fmt: skip
                family.labels(str(i))

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
    retries: int = 1,
    health_interval: float = 2.0,
) -> FastAPI:
    """The app; `clients` (one per replica) default to plain HTTP clients of `replicas`'
    URLs. A request whose replica fails is resubmitted to a live one up to `retries` times
    (0: it ends with an error naming the replica); every `health_interval` seconds each
    replica's /health is asked, so a dead one is marked down and a restarted one rejoins."""
    clients = list(clients or [httpx.AsyncClient(base_url=u, timeout=None) for u in replicas])
    metrics = ProxyMetrics(len(clients))
    app = FastAPI(title="servelab route")
    app.state.dispatcher, app.state.metrics = dispatcher, metrics
    counter = iter(range(1 << 62))
    watch = HealthWatch(dispatcher, clients, metrics, health_interval)
    app.state.health = watch

    @app.get("/health")
    async def health():
        watch.ensure_running()
        live = [i for i in range(len(clients)) if i not in dispatcher.down]
        status = 200 if live else 503
        return JSONResponse({"status": "ok" if live else "no live replica",
                             "replicas": list(replicas), "down": sorted(dispatcher.down)},
                            status_code=status)  # fmt: skip

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.text(), media_type="text/plain; version=0.0.4")

    @app.get("/replicas/{index}/{what}")
    async def replica_page(index: int, what: str):
        """A replica's own /metrics or /health (Ray replicas have no address of their own)."""
        if what not in ("metrics", "health") or not 0 <= index < len(clients):
            return _error(404, f"no /replicas/{index}/{what}: replicas 0..{len(clients) - 1}, "
                          "pages metrics and health", "not_found")  # fmt: skip
        try:
            reply = await clients[index].get(f"/{what}", timeout=10)
        except httpx.TransportError as err:
            return _error(502, f"replica {index} failed: {err}", "server_error")
        return Response(reply.content, status_code=reply.status_code,
                        media_type=reply.headers.get("content-type"))  # fmt: skip

    @app.get("/v1/models")
    async def models():
        live = [i for i in range(len(clients)) if i not in dispatcher.down] or [0]
        reply = await clients[live[0]].get("/v1/models")
        return JSONResponse(reply.json(), status_code=reply.status_code)

    async def forward(request: Request, path: str):
        watch.ensure_running()
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError:
            return _error(400, "the body is not JSON", "invalid_request_error")
        if not isinstance(body, dict):
            return _error(400, "the body is not a JSON object", "invalid_request_error")
        call = _Call(f"route-{next(counter)}", body, raw, path, request.headers)
        upstream = await attempt(call)
        if isinstance(upstream, Response):
            return upstream
        if not body.get("stream") or upstream.status_code != 200:
            return await whole(call, upstream)
        return StreamingResponse(relay(call, upstream), status_code=upstream.status_code,
                                 media_type=upstream.headers.get("content-type", "text/event-stream"))  # fmt: skip

    async def attempt(call: _Call) -> httpx.Response | Response:
        """Routes `call` and opens its response; a replica that cannot be reached is marked
        down and the call resubmitted while retries are left."""
        while True:
            try:
                index = route(call)
            except NoLiveReplica as err:
                return _error(503, str(err), "server_error")
            client = clients[index]
            try:
                return await client.send(client.build_request("POST", call.path, content=call.raw,
                                                              headers=call.headers), stream=True)  # fmt: skip
            except httpx.TransportError as err:
                if not failed(call, err):
                    return _error(502, f"replica {index} failed: {err}", "server_error")

    def route(call: _Call) -> int:
        busy_before = dispatcher.sent_to_busy_while_idle
        call.replica = dispatcher.dispatch(
            routed_view(call.request_id, call.body, time.monotonic())
        )
        if dispatcher.sent_to_busy_while_idle > busy_before:
            metrics.sent_to_busy.inc()
        label = str(call.replica)
        metrics.routed.labels(label).inc()
        metrics.in_flight.labels(label).inc()
        return call.replica

    def failed(call: _Call, err: BaseException) -> bool:
        """`call`'s replica failed: marks it down and ends this attempt; whether to resubmit."""
        watch.down(call.replica, err)
        done(call, failed=True)
        retry = call.attempts < retries and len(dispatcher.down) < len(clients)
        if retry:
            call.attempts += 1
            metrics.resubmitted.labels(str(call.replica)).inc()
        return retry

    def done(call: _Call, failed: bool) -> None:
        dispatcher.finished(call.request_id)
        label = str(call.replica)
        metrics.in_flight.labels(label).dec()
        if failed:
            metrics.failed.labels(label).inc()

    async def whole(call: _Call, upstream: httpx.Response) -> Response:
        while True:
            try:
                content = await upstream.aread()
                break
            except httpx.TransportError as err:
                await upstream.aclose()
                if not failed(call, err):
                    return _error(502, f"replica {call.replica} failed: {err}", "server_error")
                reopened = await attempt(call)
                if isinstance(reopened, Response):
                    return reopened
                upstream = reopened
        await upstream.aclose()
        metrics.first_byte.observe(time.perf_counter() - call.started)
        done(call, failed=upstream.status_code >= 500)
        return Response(content, status_code=upstream.status_code,
                        media_type=upstream.headers.get("content-type"))  # fmt: skip

    async def relay(call: _Call, upstream: httpx.Response):
        ledger = StreamLedger()
        first = True
        ended = False
        try:
            while True:
                try:
                    async for chunk in upstream.aiter_raw():
                        for event in ledger.feed(chunk):
                            if first:
                                first = False
                                metrics.first_byte.observe(time.perf_counter() - call.started)
                                dispatcher.started(call.request_id)
                            yield event
                    if not ledger.done:
                        # a replica's stream always ends with [DONE]: one that stops short
                        # lost its replica (a Ray generator may end so when its actor dies)
                        raise httpx.ReadError("its stream ended before [DONE]")
                    break
                except httpx.TransportError as err:
                    await upstream.aclose()
                    if ledger.done:  # it broke after the whole stream went out
                        break
                    reason = f"replica {call.replica} failed: {err}"
                    if ledger.delivered and not resumable(call.body):
                        # a sampled request without a seed cannot continue elsewhere
                        watch.down(call.replica, err)
                        done(call, failed=True)
                        ended = True
                        yield _stream_error(reason + "; an unseeded sampled stream cannot resume")
                        return
                    if not failed(call, err):
                        ended = True
                        yield _stream_error(reason)
                        return
                    reopened = await attempt(call)
                    if isinstance(reopened, Response):
                        ended = True
                        yield _stream_error(json.loads(bytes(reopened.body))["error"]["message"])
                        return
                    upstream = reopened
                    ledger.resubmitted()
        finally:
            await upstream.aclose()
            if not ended:
                done(call, failed=upstream.status_code >= 500)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await forward(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await forward(request, "/v1/chat/completions")

    return app


class _Call:
    """One client request through the proxy, across its attempts."""

    def __init__(self, request_id: str, body: dict, raw: bytes, path: str, headers) -> None:
        self.request_id, self.body, self.raw, self.path = request_id, body, raw, path
        auth = {k: v for k, v in headers.items() if k.lower() == "authorization"}
        self.headers = {**auth, "content-type": "application/json"}
        self.replica = -1
        self.attempts = 0  # resubmissions so far
        self.started = time.perf_counter()


def _error(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}},
                        status_code=status)  # fmt: skip


def _stream_error(message: str) -> bytes:
    error = {"error": {"message": message, "type": "server_error", "code": 502}}
    return f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()


class HealthWatch:
    """Asks every replica's /health each `interval` seconds, on the proxy's event loop:
    a replica that fails to answer 200 is down (the dispatcher routes around it) until it
    answers again. A failed request marks its replica down at once."""

    def __init__(self, dispatcher: Dispatcher, clients: Sequence[httpx.AsyncClient],
                 metrics: ProxyMetrics, interval: float) -> None:  # fmt: skip
        self.dispatcher, self.clients, self.metrics = dispatcher, clients, metrics
        self.interval = interval
        self.task: asyncio.Task | None = None
        self.reasons: dict[int, str] = {}
        for i in range(len(clients)):
            metrics.up.labels(str(i)).set(1)

    def ensure_running(self) -> None:
        if self.interval > 0 and (self.task is None or self.task.done()):
            self.task = asyncio.get_running_loop().create_task(self._watch())

    def down(self, index: int, reason: BaseException | str) -> None:
        if index not in self.dispatcher.down:
            self.dispatcher.down.add(index)
            self.metrics.up.labels(str(index)).set(0)
            self.metrics.marked_down.labels(str(index)).inc()
        self.reasons[index] = str(reason)

    def up(self, index: int) -> None:
        if index in self.dispatcher.down:
            self.dispatcher.down.discard(index)
            self.metrics.up.labels(str(index)).set(1)
            self.reasons.pop(index, None)

    async def check(self, index: int) -> None:
        try:
            reply = await self.clients[index].get("/health", timeout=max(self.interval, 5.0))
        except (httpx.TransportError, httpx.TimeoutException) as err:
            self.down(index, err)
            return
        if reply.status_code == 200:
            self.up(index)
        else:
            self.down(index, f"/health answered {reply.status_code}")

    async def _watch(self) -> None:
        while True:
            await asyncio.gather(*(self.check(i) for i in range(len(self.clients))))
            await asyncio.sleep(self.interval)
