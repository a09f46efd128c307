"""A submission's Deltas as OpenAI's responses: server-sent events for a stream,
one JSON body otherwise.

A stream sends one event per choice with news (vLLM's shape: one choice per chunk
when n > 1), usage at the end with `stream_options.include_usage` and in every
chunk with `continuous_usage_stats` too, then `data: [DONE]`. Every way a stream
can end early ends it the same way, with an error event and `[DONE]`: a request
the engine rejected or failed (a failure's details go to the server's log, not to
the client), and a server shutting down. A response that does
not stream learns that its client left from the ASGI `http.disconnect` message
(a task waits for it), so it is aborted at once however busy the engine is.
"""

from __future__ import annotations

import asyncio
import json
import logging

from fastapi.responses import JSONResponse, Response

from servelab.serve.choices import Choices
from servelab.serve.protocol import ApiError
from servelab.serve.submission import CLOSING, GONE, Submission

log = logging.getLogger(__name__)

SHUTDOWN = "the server is shutting down"
ENGINE_FAILED = "the request failed in the engine; the server log has the details"


def _failure(delta) -> ApiError | None:
    if delta.rejected:
        return ApiError(400, delta.error or "bad request", "prompt")
    if delta.finished and delta.output is not None and delta.output.finish_reason == "error":
        # the client learns that it failed, the server's log what failed (no internals out)
        log.warning("request %s: %s", delta.output.request_id, delta.output.error)
        return ApiError(500, ENGINE_FAILED)
    return None


def _event(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"


async def stream_events(sub: Submission, choices: Choices, head: dict, chat: bool,
                        usage: bool, continuous: bool, echo, metrics,
                        prompt_logprobs=None):  # fmt: skip
    """`prompt_logprobs(request_id)`: awaitable, an echoed prompt's logprobs (echo with
    logprobs: a prompt's echo chunk waits for its first tokens, and carries them)."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    try:
        count = len(choices.texts)
        for i in range(count):  # the first chunk per choice
            if chat:
                first = {"index": i, "delta": {"role": "assistant", "content": ""},
                         "logprobs": None, "finish_reason": None}  # fmt: skip
            elif echo is not None and not choices.echo_logprobs:
                first = {"index": i, "text": echo[i // choices.n], "logprobs": None,
                         "finish_reason": None}  # fmt: skip
            else:
                continue
            yield _event(_chunk(head, kind, first, choices if continuous else None))
        echoed: set[int] = set()  # prompts whose echo chunk went out (echo with logprobs)
        held: dict[int, list] = {}  # their Deltas until then
        async for item in sub.events():
            if item[1] is None:  # CLOSING (a GONE client has no one to tell)
                yield _event(ApiError(503, SHUTDOWN).body())
                break
            metrics.observe(item)
            error = _failure(item[1])
            if error is not None:
                yield _event(error.body())
                break
            items = [item]
            if choices.echo_logprobs and item[0] not in echoed:
                index, delta = item
                entries = delta.output.prompt_logprobs if delta.finished and delta.output else None
                if entries is None and index not in held:
                    entries = await prompt_logprobs(delta.request_id)
                if entries is None and not delta.finished:  # it finished meanwhile: its
                    held.setdefault(index, []).append(item)  # final Delta will carry them
                    continue
                echoed.add(index)
                for first in _echo_chunks(index, entries, choices, echo):
                    yield _event(_chunk(head, kind, first, choices if continuous else None))
                items = held.pop(index, []) + items
            for piece in (p for it in items for p in choices.apply(*it)):
                if chat:
                    piece = {"index": piece["index"], "delta": {"content": piece["text"]},
                             "logprobs": piece["logprobs"], "finish_reason": piece["finish_reason"],
                             "stop_reason": piece["stop_reason"], "token_ids": piece["token_ids"]}  # fmt: skip
                yield _event(_chunk(head, kind, piece, choices if continuous else None))
        else:
            if usage:
                yield _event({**head, "object": kind, "choices": [], "usage": choices.usage()})
        yield "data: [DONE]\n\n"
    finally:
        sub.close()
        metrics.discard_timings(sub.ids)


def _echo_chunks(index: int, entries, choices: Choices, echo) -> list[dict]:
    """A prompt's echo chunks (one per choice), with its prompt logprobs."""
    logprobs = choices.prompt_logprobs_json(index, entries)
    return [{"index": i, "text": echo[index], "logprobs": logprobs, "finish_reason": None}
            for i in range(index * choices.n, (index + 1) * choices.n)]  # fmt: skip


def _chunk(head: dict, kind: str, choice: dict, usage_of: Choices | None) -> dict:
    body = {**head, "object": kind, "choices": [choice]}
    if usage_of is not None:
        body["usage"] = usage_of.usage()
    return body


async def _wait_gone(request, sub: Submission) -> None:
    """Marks the submission GONE when the client disconnects (the body is read already,
    so the next ASGI message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            sub.mark(GONE)
            return


async def whole_response(request, sub: Submission, choices: Choices, head: dict, chat: bool,
                         echo, metrics) -> Response:  # fmt: skip
    watcher = asyncio.ensure_future(_wait_gone(request, sub))
    try:
        async for item in sub.events():
            if item[0] == GONE:
                return Response(status_code=499)
            if item[0] == CLOSING:
                raise ApiError(503, SHUTDOWN)
            metrics.observe(item)
            error = _failure(item[1])
            if error is not None:
                raise error
            choices.apply(*item)
    finally:
        watcher.cancel()
        sub.close()
        metrics.discard_timings(sub.ids)
    body = {**head, "object": "chat.completion" if chat else "text_completion",
            "choices": choices.final(echo), "usage": choices.usage()}  # fmt: skip
    return JSONResponse(body)
