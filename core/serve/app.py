"""The OpenAI-compatible HTTP app (FastAPI) over one `AsyncEngine`, with vLLM's routes
and conventions.

Every request is checked before the engine sees it, cheapest check first: auth (a
wrong key reaches no engine code), the body's size and arrival (`limits`), its
fields (`protocol`), the model's name, list sizes, then prompt lengths before any
tokenizing (done on a worker thread) or per-id check. An admitted request's engine
requests are submitted in the same event-loop turn as the queue check that counted
them (`submission`). Errors use OpenAI's JSON shape on every route: 400 bad request
(naming the field), 401 wrong key, 404 unknown model or route, 408 slow body, 413
body too large, 429 full queue, 500 an engine failure of the request it touched,
503 shutting down or an engine that stopped.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from importlib.metadata import PackageNotFoundError, version

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from servelab.engine.grammar_queue import cannot_constrain
from servelab.errors import RequestError
from servelab.model.grammar import build_grammar
from servelab.serve.async_engine import AsyncEngine
from servelab.serve.choices import Choices
from servelab.serve.limits import PromptChecker, check_sizes, output_budget, read_body
from servelab.serve.metrics import ServerMetrics
from servelab.serve.protocol import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    prompts_of,
    sampling_params,
    unsupported,
    validation_error,
)
from servelab.serve.responses import stream_events, whole_response
from servelab.serve.submission import Submission
from servelab.serve.text import ChatTemplate
from servelab.step.sequence import SamplingParams

LARGE_BODY = 1 << 16  # bodies past this many bytes are parsed on a worker thread


def _no_telemetry() -> dict:
    """FastAPI's native OpenTelemetry instrumentation off (FastAPI versions that have
    it wrap every ASGI message, so every streamed chunk, even with no exporter set);
    the server's figures are its Prometheus `/metrics`."""
    import inspect

    if "telemetry" not in inspect.signature(FastAPI.__init__).parameters:
        return {}
    off = ("tracing", "metrics", "logs", "operation_spans")
    return {"telemetry": dict.fromkeys(off, False)}


def servelab_version() -> str:
    try:
        return version("servelab")
    except PackageNotFoundError:
        return "unknown"


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
    app.state.live = live = set()  # open submissions (shutdown tells each)
    api_key = options.get("api_key")
    vocab = engine.model_config.vocab_size
    max_len = engine.max_model_len
    app.state.checker = checker = PromptChecker(engine.tokenizer, vocab, max_len)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, err: ApiError):
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException):  # unknown route, wrong method
        body = ApiError(err.status_code, str(err.detail), kind="invalid_request_error").body()
        return JSONResponse(body, status_code=err.status_code)

    if api_key:
        app.add_middleware(BearerAuth, api_key=api_key)

    @app.get("/health")
    async def health():
        problem = aengine.problem()
        if problem is not None:
            return JSONResponse(ApiError(503, problem).body(), status_code=503)
        return {"status": "ok"}

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping():
        return await health()

    @app.get("/version")
    async def server_version():
        return {"version": servelab_version()}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.text(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model",
                "created": 0, "owned_by": "servelab", "root": model_name, "max_model_len": max_len,
                "vocab_size": vocab, "servelab_choices": choices or {}}]}  # fmt: skip

    async def parse(request: Request, model):
        body = await read_body(request, options["max_body_bytes"], options["body_timeout"])
        try:
            if len(body) > LARGE_BODY:
                req = await asyncio.to_thread(model.model_validate_json, body)
            else:
                req = model.model_validate_json(body)
        except ValidationError as err:
            raise validation_error(err.errors()) from None
        if getattr(req, "model", None) not in (None, model_name):
            raise ApiError(404, f"The model `{req.model}` does not exist: this server serves "
                                f"`{model_name}` (or leave `model` out).", "model")  # fmt: skip
        return req

    async def chat_prompt(req: ChatRequest) -> str:
        messages = [m.for_template() for m in req.messages]
        for m in messages:
            checker.check_text(m["content"], "messages")
        return await asyncio.to_thread(template.render, messages, req.add_generation_prompt,
                                       req.chat_template_kwargs)  # fmt: skip

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await read_body(request, options["max_body_bytes"], options["body_timeout"])
        data = _json_object(body)
        if "messages" in data:
            req = await asyncio.to_thread(ChatRequest.model_validate, data)
            ids = await checker.token_ids(await chat_prompt(req), "messages", False)
        elif isinstance(data.get("prompt"), str):
            ids = await checker.token_ids(data["prompt"], "prompt",
                                          data.get("add_special_tokens", True) is True)  # fmt: skip
        else:
            raise ApiError(400, "send `prompt` (text) or `messages`", "prompt")
        return {"count": len(ids), "max_model_len": max_len, "tokens": ids, "token_strs": None}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await read_body(request, options["max_body_bytes"], options["body_timeout"])
        tokens = _json_object(body).get("tokens")
        if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
            raise ApiError(400, "tokens must be a list of token ids", "tokens")
        if len(tokens) > max_len or (tokens and (min(tokens) < 0 or max(tokens) >= vocab)):
            raise ApiError(400, f"tokens must be at most {max_len} ids in [0, {vocab})", "tokens")
        if engine.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer", "tokens")
        return {"prompt": await asyncio.to_thread(engine.tokenizer.decode, tokens)}

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await parse(request, CompletionRequest)
        unsupported(req)
        check_sizes(req, options, vocab)
        texts = prompts_of(req.prompt)
        if len(texts) > options["max_prompts"]:
            raise ApiError(400, f"prompt holds {len(texts)} prompts, more than "
                           f"serve.max_prompts={options['max_prompts']}", "prompt")  # fmt: skip
        add_special = req.add_special_tokens is not False
        prompts = [await checker.token_ids(p, "prompt", add_special) for p in texts]
        params = [_params(req, output_budget(req.max_tokens, len(p), max_len, 16), req.logprobs)
                  for p in prompts]  # fmt: skip
        await check_constraint(params[0])
        if req.echo and req.logprobs is not None:  # the echoed prompt's logprobs too (vLLM)
            params = [dataclasses.replace(p, prompt_logprobs=req.logprobs) for p in params]
        echo = None
        if req.echo:
            echo = [await asyncio.to_thread(engine.tokenizer.decode, p) if engine.tokenizer
                    else "" for p in prompts]  # fmt: skip
        return await run(request, req, prompts, params, chat=False, echo=echo)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req = await parse(request, ChatRequest)
        unsupported(req)
        check_sizes(req, options, vocab)
        if req.top_logprobs is not None and not req.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        add_special = req.add_special_tokens is True  # the template has them (vLLM's default)
        prompt = await checker.token_ids(await chat_prompt(req), "messages", add_special)
        requested = req.max_completion_tokens or req.max_tokens
        k = (req.top_logprobs or 0) if req.logprobs else None
        params = _params(req, output_budget(requested, len(prompt), max_len, None), k)
        await check_constraint(params)
        return await run(request, req, [prompt], [params], chat=True, echo=None)

    async def check_constraint(params: SamplingParams) -> None:
        """A 400 for an output constraint this engine cannot serve or xgrammar cannot
        build, before any engine work (the engine compiles it on its own thread)."""
        constraint = params.structured_outputs
        if constraint is None:
            return
        problem = cannot_constrain(engine.executor)
        if problem is not None:
            raise ApiError(400, problem, "structured_outputs")
        try:
            await asyncio.to_thread(build_grammar, constraint)
        except RequestError as err:
            raise ApiError(400, str(err), "structured_outputs") from None

    def _params(req, max_tokens: int, logprobs):
        min_tokens = req.min_tokens
        if min_tokens > max_tokens:  # the context left less room than asked for
            req = req.model_copy(update={"min_tokens": max_tokens})
        return sampling_params(req, max_tokens, logprobs, options["max_n"])

    async def run(request: Request, req, prompts, params, chat: bool, echo):
        if problem := aengine.problem():
            raise ApiError(503, problem)
        limit = options["max_queued_requests"]
        if aengine.num_pending + len(prompts) > limit:
            raise ApiError(429, f"the server is full ({limit} requests queued or running; "
                           "serve.max_queued_requests); retry later")  # fmt: skip
        kind = "chatcmpl" if chat else "cmpl"
        base = f"{kind}-{uuid.uuid4().hex}"
        # no await between the check above and this submission: the count stays exact
        sub = Submission(aengine, base, prompts, params, req.priority, live)
        n = params[0].n
        out = Choices(engine.tokenizer, prompts, n, params[0].stop, params[0].logprobs, chat)
        out.echo_logprobs = params[0].prompt_logprobs is not None
        head = {"id": base, "created": int(time.time()), "model": model_name}
        if req.stream:
            so = req.stream_options
            usage = so is not None and bool(so.include_usage)
            continuous = usage and bool(so.continuous_usage_stats)
            return StreamingResponse(
                stream_events(sub, out, head, chat, usage, continuous, echo, metrics,
                              lambda rid: asyncio.to_thread(aengine.loop.prompt_logprobs, rid)),
                media_type="text/event-stream",
            )
        return await whole_response(request, sub, out, head, chat, echo, metrics)

    return app


def _json_object(body: bytes) -> dict:
    import json

    try:
        data = json.loads(body)
    except ValueError as err:
        raise ApiError(400, f"the request body is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return data
