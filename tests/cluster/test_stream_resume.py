"""A stream resubmitted to another replica continues where the first one stopped: whatever
the chunking of either attempt's bytes and events, and wherever the first one broke, the
client reads each choice's text, token ids and logprob entries once, in order, with one role
chunk, one finish and the first attempt's id (StreamLedger; then the proxy end to end with
stand-in replicas)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servelab.cluster.dispatch import Dispatcher, NoLiveReplica
from servelab.cluster.proxy import create_proxy_app
from servelab.cluster.resume import StreamLedger, resumable
from servelab.registry.construct import construct

WORDS = ["a", "bé", "cat", " ", "日本", "\n", "🙂", "dog"]


def answer(choices: int, length: int) -> list[list[tuple[int, str]]]:
    """Per choice: its tokens as (token id, text)."""
    return [[(100 * c + i, WORDS[(c + 3 * i) % len(WORDS)]) for i in range(length)]
            for c in range(choices)]  # fmt: skip


def events(full, chat: bool, cuts: list[int], stream_id: str) -> list[dict]:
    """The stream a server sends for `full`, its tokens grouped into events at `cuts`."""
    out = []
    if chat:
        for c in range(len(full)):
            out.append({"id": stream_id, "choices": [{"index": c, "delta": {"role": "assistant",
                        "content": ""}, "logprobs": None, "finish_reason": None}]})  # fmt: skip
    for c, tokens in enumerate(full):
        bounds = sorted({0, len(tokens), *(x % (len(tokens) + 1) for x in cuts)})
        for lo, hi in zip(bounds, bounds[1:]):
            part = tokens[lo:hi]
            text = "".join(t for _, t in part)
            ids = [i for i, _ in part]
            last = hi == len(tokens)
            finish = "length" if last else None
            if chat:
                lp = {"content": [{"token": t, "logprob": -0.5} for _, t in part]}
                choice = {"index": c, "delta": {"content": text}, "logprobs": lp,
                          "finish_reason": finish, "token_ids": ids}  # fmt: skip
            else:
                lp = {"tokens": [t for _, t in part], "token_logprobs": [-0.5] * len(part),
                      "top_logprobs": [{t: -0.5} for _, t in part],
                      "text_offset": list(range(lo, hi))}  # fmt: skip
                choice = {"index": c, "text": text, "logprobs": lp, "finish_reason": finish,
                          "token_ids": ids}  # fmt: skip
            out.append({"id": stream_id, "object": "x", "choices": [choice]})
    out.append({"id": stream_id, "choices": [], "usage": {"completion_tokens": 7}})
    return out


def wire(stream: list[dict]) -> bytes:
    return b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in stream) + b"data: [DONE]\n\n"


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    bounds = sorted({0, len(data), *(c % (len(data) + 1) for c in cuts)})
    return [data[a:b] for a, b in zip(bounds, bounds[1:])]


def read(received: list[bytes], chat: bool) -> dict:
    per: dict[int, dict] = {}
    ids, done, usage = set(), 0, 0
    for event in received:
        assert event.endswith(b"\n\n"), "the proxy sent half an event"
        payload = event.decode()[6:].strip()
        if payload == "[DONE]":
            done += 1
            continue
        body = json.loads(payload)
        ids.add(body["id"])
        usage += "usage" in body
        for choice in body["choices"]:
            got = per.setdefault(choice["index"], {"text": "", "ids": [], "lp": [], "roles": 0,
                                                   "finishes": 0})  # fmt: skip
            holder = choice["delta"] if chat else choice
            got["text"] += holder.get("content" if chat else "text") or ""
            got["roles"] += "role" in holder
            got["ids"] += choice["token_ids"] if "token_ids" in choice else []
            lp = choice.get("logprobs") or {}
            got["lp"] += (lp.get("content") if chat else lp.get("tokens")) or []
            got["finishes"] += choice["finish_reason"] is not None
    return {"per": per, "ids": ids, "done": done, "usage": usage}


@settings(max_examples=150, deadline=None)
@given(chat=st.booleans(), choices=st.integers(1, 3), length=st.integers(1, 12),
       cuts_a=st.lists(st.integers(0, 50), max_size=6), cuts_b=st.lists(st.integers(0, 50), max_size=6),
       bytes_a=st.lists(st.integers(0, 5000), max_size=12), bytes_b=st.lists(st.integers(0, 5000), max_size=12),
       broken_after=st.integers(0, 40))  # fmt: skip
def test_a_resumed_stream_reads_as_one(chat, choices, length, cuts_a, cuts_b, bytes_a, bytes_b,
                                       broken_after):  # fmt: skip
    full = answer(choices, length)
    ledger = StreamLedger()
    received = []
    first = split(wire(events(full, chat, cuts_a, "first")), bytes_a)
    for chunk in first[:broken_after]:  # the first replica dies after these bytes
        received += ledger.feed(chunk)
    first_id = "first" if received else "second"  # the id of the first event the client read
    if broken_after < len(first):
        ledger.resubmitted()
        for chunk in split(wire(events(full, chat, cuts_b, "second")), bytes_b):
            received += ledger.feed(chunk)
    got = read(received, chat)
    assert got["ids"] == {first_id} and got["done"] == 1 and got["usage"] == 1
    for c, tokens in enumerate(full):
        mine = got["per"][c]
        assert mine["text"] == "".join(t for _, t in tokens)
        assert mine["ids"] == [i for i, _ in tokens]
        assert [e["token"] if chat else e for e in mine["lp"]] == [t for _, t in tokens]
        assert mine["finishes"] == 1 and mine["roles"] == (1 if chat else 0)


def test_only_greedy_or_seeded_requests_resume():
    assert resumable({"temperature": 0}) and resumable({"temperature": 0.0})
    assert resumable({"temperature": 0.7, "seed": 3}) and resumable({"seed": 0})
    assert not resumable({}) and not resumable({"temperature": 1.0})


# -- the proxy, in front of stand-in replicas that stream or die
FULL = answer(1, 10)


class Replica:
    """Streams the completion for FULL; `die_after` events in, it drops the connection
    (`quietly`: its stream just ends there, as a dead Ray actor's generator may)."""

    def __init__(self, die_after: int | None = None, quietly: bool = False) -> None:
        self.die_after, self.quietly, self.calls = die_after, quietly, 0

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.calls += 1
        body = json.loads(request.content)
        stream = events(FULL, False, [3, 7], f"id-{id(self)}")
        if not body.get("stream"):
            if self.die_after is not None:
                raise httpx.ReadError("connection reset", request=request)
            return httpx.Response(200, json={"choices": [{"text": "whole"}]})
        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              stream=_Dying(wire(stream), self.die_after, request, self.quietly))  # fmt: skip


class _Dying(httpx.AsyncByteStream):
    def __init__(self, data: bytes, die_after: int | None, request, quietly=False) -> None:
        self.parts = [p + b"\n\n" for p in data.split(b"\n\n") if p]
        self.die_after, self.request, self.quietly = die_after, request, quietly

    async def __aiter__(self):
        for n, part in enumerate(self.parts):
            if n == self.die_after:
                if self.quietly:
                    return
                raise httpx.ReadError("connection reset", request=self.request)
            yield part[:5]  # events arrive in pieces
            yield part[5:]
        if self.die_after == len(self.parts):  # the connection breaks after [DONE]
            raise httpx.ReadError("connection reset", request=self.request)


def proxy(replicas, retries=1):
    clients = [httpx.AsyncClient(transport=httpx.MockTransport(r), base_url=f"http://r{i}")
               for i, r in enumerate(replicas)]  # fmt: skip
    dispatcher = Dispatcher(construct("router", "round_robin", num_replicas=len(replicas)),
                            len(replicas))  # fmt: skip
    return create_proxy_app(dispatcher, [f"r{i}" for i in range(len(replicas))], clients,
                            retries=retries, health_interval=0), dispatcher  # fmt: skip


def call(app, body: dict) -> tuple[int, str, str]:
    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://route") as client:
            reply = await client.post("/v1/completions", json=body)
            return reply.status_code, reply.text, (await client.get("/metrics")).text

    return asyncio.run(go())


def test_the_proxy_continues_a_broken_stream_on_a_live_replica():
    dying, live = Replica(die_after=4), Replica()
    app, dispatcher = proxy([dying, live])
    status, text, metrics = call(app, {"prompt": "x", "stream": True, "temperature": 0})
    got = read([e + b"\n\n" for e in text.encode().split(b"\n\n") if e], chat=False)
    assert status == 200 and got["per"][0]["text"] == "".join(t for _, t in FULL[0])
    assert got["per"][0]["ids"] == [i for i, _ in FULL[0]] and got["done"] == 1
    assert dispatcher.decisions == [("route-0", 0), ("route-0", 1)]
    assert dispatcher.down == {0} and live.calls == 1
    assert 'servelab_route_resubmitted_total{replica="0"} 1.0' in metrics
    assert 'servelab_route_replica_up{replica="0"} 0.0' in metrics
    # the next request goes around the dead replica, whatever round robin says
    call(app, {"prompt": "y", "stream": True, "temperature": 0})
    assert dispatcher.decisions[-1][1] == 1 and dispatcher.rerouted_from_down == 1


@pytest.mark.parametrize("retries", [0, 1])
def test_a_stream_that_ends_before_done_is_a_failed_replica(retries):
    """No error and no [DONE], the stream just stops: the replica failed (resubmitted while
    retries are left, else an error event) and the client never reads a cut answer as whole."""
    dying, live = Replica(die_after=4, quietly=True), Replica()
    app, dispatcher = proxy([dying, live], retries=retries)
    status, text, metrics = call(app, {"prompt": "x", "stream": True, "temperature": 0})
    assert status == 200 and text.rstrip().endswith("data: [DONE]") and dispatcher.down == {0}
    assert 'servelab_route_failures_total{replica="0"} 1.0' in metrics
    if retries:
        got = read([e + b"\n\n" for e in text.encode().split(b"\n\n") if e], chat=False)
        assert got["done"] == 1 and live.calls == 1
        assert got["per"][0]["text"] == "".join(t for _, t in FULL[0])
    else:
        assert "replica 0 failed" in text and "ended before [DONE]" in text
        assert live.calls == 0


def test_a_stream_that_broke_after_done_is_whole_and_not_resubmitted():
    parts = len(wire(events(FULL, False, [3, 7], "x")).split(b"\n\n")) - 1
    dying, live = Replica(die_after=parts), Replica()
    app, dispatcher = proxy([dying, live])
    status, text, _ = call(app, {"prompt": "x", "stream": True, "temperature": 0})
    assert read([e + b"\n\n" for e in text.encode().split(b"\n\n") if e], False)["done"] == 1
    assert live.calls == 0 and len(dispatcher.decisions) == 1


def test_an_unseeded_sampled_stream_ends_with_an_error_naming_the_replica():
    app, dispatcher = proxy([Replica(die_after=4), Replica()])
    status, text, metrics = call(app, {"prompt": "x", "stream": True})
    assert status == 200 and "replica 0 failed" in text and "cannot resume" in text
    assert text.rstrip().endswith("data: [DONE]")
    assert 'servelab_route_resubmitted_total{replica="0"} 0.0' in metrics


def test_a_stream_that_broke_before_any_token_is_resubmitted_even_if_sampled():
    app, _ = proxy([Replica(die_after=0), Replica()])
    status, text, _ = call(app, {"prompt": "x", "stream": True})
    assert status == 200 and "error" not in text
    assert read([e + b"\n\n" for e in text.encode().split(b"\n\n") if e], False)["done"] == 1


def test_with_retries_off_the_request_fails_and_names_its_replica():
    app, _ = proxy([Replica(die_after=4), Replica()], retries=0)
    status, text, metrics = call(app, {"prompt": "x", "stream": True, "temperature": 0})
    assert (
        "replica 0 failed" in text and 'servelab_route_failures_total{replica="0"} 1.0' in metrics
    )
    status, text, _ = call(proxy([Replica(die_after=1), Replica()], retries=0)[0], {"prompt": "x"})
    assert status == 502 and "replica 0 failed" in text


def test_a_whole_response_is_retried_and_no_live_replica_is_a_503():
    app, dispatcher = proxy([Replica(die_after=1), Replica()])
    status, text, _ = call(app, {"prompt": "x"})
    assert status == 200 and json.loads(text)["choices"][0]["text"] == "whole"
    app, dispatcher = proxy([Replica(die_after=1)])
    status, text, _ = call(app, {"prompt": "x"})
    assert status == 502 and "replica 0 failed" in text
    status, text, _ = call(app, {"prompt": "x"})
    assert status == 503 and "all 1 replicas are down" in text
    assert isinstance(NoLiveReplica("x"), Exception)
