"""The Ray actor's `request` generator relays every ASGI message the app sends, however the
app's pace and the consumer's interleave (no Ray needed: the generator is plain asyncio)."""

import asyncio

import pytest

from servelab.cluster.ray_replicas import ReplicaServer


def _server(app) -> ReplicaServer:
    server = ReplicaServer.__new__(ReplicaServer)  # the app only: no engine behind it
    server.app = app
    return server


def _collect(server: ReplicaServer, slow: bool) -> list:
    async def go():
        out = []
        async for item in server.request("POST", "/v1/completions", [], b"{}"):
            out.append(item)
            if slow:  # a consumer that lags: the app finishes while items wait in the queue
                await asyncio.sleep(0.01)
        return out

    return asyncio.run(go())


def _app(chunks: list[bytes], pause: bool):
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})  # fmt: skip
        for n, chunk in enumerate(chunks):
            if pause:
                await asyncio.sleep(0)
            await send({"type": "http.response.body", "body": chunk,
                        "more_body": n < len(chunks) - 1})  # fmt: skip

    return app


@pytest.mark.parametrize("pause", [False, True], ids=["app-at-once", "app-paced"])
@pytest.mark.parametrize("slow", [False, True], ids=["eager-reader", "lagging-reader"])
def test_every_chunk_reaches_the_consumer_even_after_the_app_returned(pause, slow):
    chunks = [f"data: {n}\n\n".encode() for n in range(20)] + [b"data: [DONE]\n\n"]
    items = _collect(_server(_app(chunks, pause)), slow)
    assert items[0] == (200, [("content-type", "text/event-stream")])
    assert b"".join(items[1:]) == b"".join(chunks)


def test_an_app_that_fails_before_answering_raises_in_the_consumer():
    async def app(scope, receive, send):
        raise RuntimeError("the app broke")

    with pytest.raises(RuntimeError, match="the app broke"):
        _collect(_server(app), slow=False)
