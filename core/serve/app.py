"""The OpenAI-compatible HTTP app (FastAPI) over one `AsyncEngine`.

Every request is checked before the engine sees it (auth first: a wrong key
reaches no engine code), then becomes one engine request per prompt. A stream
sends one server-sent event per engine step that brought tokens; a client that
goes away aborts its engine requests, which frees their blocks. Errors use
OpenAI's JSON shape: 400 bad request (naming the field), 401 wrong key, 429
full queue, 500 an engine failure of the requests it touched.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from servelab.serve.async_engine import AsyncEngine
from servelab.serve.choices import Choices
from servelab.serve.metrics import ServerMetrics
from servelab.serve.protocol import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    prompts_of,
    sampling_params,
    validation_error,
)
from servelab.serve.text import ChatTemplate

POLL_S = 0.25  # how often a response that does not stream checks for a gone client


def _no_telemetry() -> dict:
    """FastAPI's native OpenTelemetry instrumentation off (FastAPI versions that have
    it wrap every ASGI message, so every streamed chunk, even with no exporter set);
    the server's figures are its Prometheus `/metrics`."""
    import inspect

    if "telemetry" not in inspect.signature(FastAPI.__init__).parameters:
        return {}
    off = ("tracing", "metrics", "logs", "operation_spans")
    return {"telemetry": dict.fromkeys(off, False)}


class BearerAuth:
    """Answers 401 to a /v1 request without `Authorization: Bearer <key>`, before any
    route or engine code runs. A plain ASGI middleware: Starlette's `BaseHTTPMiddleware`
    (`@app.middleware("http")`) would relay every streamed chunk through an extra
    memory stream and task switch, a cost paid per token of every stream."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            headers = dict(scope.get("headers") or ())
            if headers.get(b"authorization", b"") != self.expected:
                err = ApiError(401, "missing or wrong API key (Authorization: Bearer <key>)")
                await JSONResponse(err.body(), status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(aengine: AsyncEngine, options: dict, model_name: str, template: ChatTemplate,
               metrics: ServerMetrics, choices: dict | None = None) -> FastAPI:  # fmt: skip
    engine = aengine.engine
    app = FastAPI(title="servelab", **_no_telemetry())
    api_key = options.get("api_key")

    @app.exception_handler(ApiError)
    async def api_error(request: Request, err: ApiError):
        return JSONResponse(err.body(), status_code=err.status)

    if api_key:
        app.add_middleware(BearerAuth, api_key=api_key)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.text(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model",
                "created": 0, "owned_by": "servelab", "max_model_len": engine.max_model_len,
                "vocab_size": engine.model_config.vocab_size,
                "servelab_choices": choices or {}}]}  # fmt: skip

    def parse(model, body: bytes):
        try:
            return model.model_validate_json(body)
        except ValidationError as err:
            raise validation_error(err.errors()) from None

    def token_ids(prompt, field: str) -> list[int]:
        if isinstance(prompt, str):
            if engine.tokenizer is None:
                raise ApiError(400, "this model has no tokenizer: send token ids", field)
            ids = engine.tokenizer.encode(prompt, add_special_tokens=field == "prompt").ids
        else:
            ids = list(prompt)
        vocab = engine.model_config.vocab_size
        if not ids:
            raise ApiError(400, f"{field} is empty", field)
        if any(not 0 <= t < vocab for t in ids):
            raise ApiError(
                400, f"{field} has a token id outside the vocabulary [0, {vocab})", field
            )
        if len(ids) > engine.max_model_len:
            raise ApiError(400, f"{field} has {len(ids)} tokens, more than max_model_len="
                           f"{engine.max_model_len}", field)  # fmt: skip
        return ids

    def check_stops(params) -> None:
        vocab = engine.model_config.vocab_size
        if any(not 0 <= t < vocab for t in params.stop_token_ids):
            raise ApiError(400, f"stop_token_ids must be in [0, {vocab})", "stop_token_ids")

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = parse(CompletionRequest, await request.body())
        prompts = [token_ids(p, "prompt") for p in prompts_of(req.prompt)]
        params = sampling_params(req, req.max_tokens, req.logprobs, options["max_n"])
        check_stops(params)
        echo = [engine.tokenizer.decode(p) if engine.tokenizer else "" for p in prompts]
        return await run(request, req, prompts, params, chat=False, echo=echo if req.echo else None)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req = parse(ChatRequest, await request.body())
        text = template.render([m.model_dump(exclude_none=True) for m in req.messages])
        prompt = token_ids(text, "messages")
        if req.top_logprobs is not None and not req.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        k = (req.top_logprobs or 0) if req.logprobs else None
        params = sampling_params(req, req.max_completion_tokens or req.max_tokens, k,
                                 options["max_n"])  # fmt: skip
        check_stops(params)
        return await run(request, req, [prompt], params, chat=True, echo=None)

    async def run(request: Request, req, prompts, params, chat: bool, echo):
        if aengine.num_pending + len(prompts) > options["max_queued_requests"]:
            raise ApiError(429, f"the server is full ({options['max_queued_requests']} requests "
                           "queued or running); retry later")  # fmt: skip
        kind = "chatcmpl" if chat else "cmpl"
        base = f"{kind}-{uuid.uuid4().hex}"
        choices = Choices(engine.tokenizer, prompts, params.n, params.stop, params.logprobs, chat)
        events = _merge([aengine.generate(f"{base}-{i}", p, params, req.priority)
                         for i, p in enumerate(prompts)])  # fmt: skip
        head = {"id": base, "created": int(time.time()), "model": model_name}
        if req.stream:
            usage = req.stream_options is not None and req.stream_options.include_usage
            return StreamingResponse(_sse(events, choices, head, chat, usage, echo),
                                     media_type="text/event-stream")  # fmt: skip
        # wait for the next Delta without cancelling it when the poll for a gone client
        # comes first (wait_for would cancel it, and a cancelled stream aborts its request)
        following = None
        try:
            while True:
                following = following or asyncio.ensure_future(events.__anext__())
                done, _ = await asyncio.wait({following}, timeout=POLL_S)
                if not done:
                    if await request.is_disconnected():
                        return Response(status_code=499)
                    continue
                try:
                    item = following.result()
                except StopAsyncIteration:
                    break
                following = None
                _check(*item)
                choices.apply(*item)
        finally:
            if following is not None and not following.done():
                following.cancel()  # the client went away: the stream aborts its requests
                await asyncio.wait({following})
            await events.aclose()
        if choices.error:
            raise ApiError(500, f"the engine failed: {choices.error}")
        body = {**head, "object": "chat.completion" if chat else "text_completion",
                "choices": choices.final(echo), "usage": choices.usage()}  # fmt: skip
        return JSONResponse(body)

    def _observe(item) -> None:
        metrics_times.setdefault(item[1].request_id, []).append(time.perf_counter())
        if item[1].finished:
            metrics.token_gaps(metrics_times.pop(item[1].request_id, []))

    metrics_times: dict[str, list[float]] = {}

    async def _merge(iterators):
        """(prompt index, Delta) pairs from several engine requests as they come."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i, iterator):
            async for delta in iterator:
                await queue.put((i, delta))

        tasks = [asyncio.ensure_future(pump(i, it)) for i, it in enumerate(iterators)]
        done = 0
        try:
            while done < len(tasks):
                item = await queue.get()
                done += item[1].finished
                _observe(item)
                yield item
        finally:
            for task in tasks:  # a client gone: each generator's own finally aborts it
                task.cancel()

    async def _sse(events, choices: Choices, head, chat, usage, echo):
        kind = "chat.completion.chunk" if chat else "text_completion"
        try:
            if chat:
                first = [{"index": i, "delta": {"role": "assistant", "content": ""},
                          "logprobs": None, "finish_reason": None} for i in range(len(choices.texts))]  # fmt: skip
                yield _event({**head, "object": kind, "choices": first})
            elif echo is not None:
                first = [{"index": i, "text": echo[i // choices.n], "logprobs": None,
                          "finish_reason": None} for i in range(len(choices.texts))]  # fmt: skip
                yield _event({**head, "object": kind, "choices": first})
            async for item in events:
                if item[1].rejected or (item[1].finished and item[1].error and item[1].output
                                        and item[1].output.finish_reason == "error"):  # fmt: skip
                    status = 400 if item[1].rejected else 500
                    yield _event(ApiError(status, item[1].error or "failed").body())
                    break
                pieces = choices.apply(*item)
                if chat:
                    pieces = [{"index": p["index"], "delta": {"content": p["text"]},
                               "logprobs": p["logprobs"], "finish_reason": p["finish_reason"],
                               "token_ids": p["token_ids"]} for p in pieces]  # fmt: skip
                if pieces:
                    yield _event({**head, "object": kind, "choices": pieces})
            else:
                if usage:
                    yield _event({**head, "object": kind, "choices": [], "usage": choices.usage()})
            yield "data: [DONE]\n\n"
        finally:
            await events.aclose()

    return app


def _check(index: int, delta) -> None:
    if delta.rejected:
        raise ApiError(400, delta.error or "bad request", "prompt")


def _event(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"
