"""Follow-up requests (closed-loop arrivals): a request with `after` reaches the
engine only once the request it follows has finished, `arrival_time` seconds
later; with `continues` its prompt is that request's prompt and reply, then its
own tokens."""

from __future__ import annotations

import asyncio

import pytest

from servelab.errors import ConfigError
from servelab.lab.arrivals import ArrivalQueue
from servelab.lab.runner import output_digest, serve
from servelab.lab.workload import WorkloadRequest
from servelab.llm import LLM
from servelab.step.sequence import SamplingParams


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def chat() -> list[WorkloadRequest]:
    """`a` at 0; `b` continues it (prompt, reply, then [8, 9]); `c` only waits for
    it, 0.25 s after it finished; `d` is independent."""
    return [
        WorkloadRequest([5, 6, 7], params(4), request_id="a"),
        WorkloadRequest([8, 9], params(3), request_id="b", after="a", continues=True),
        WorkloadRequest([10, 11], params(2), 0.25, request_id="c", after="a"),
        WorkloadRequest([12, 13, 14], params(5), request_id="d"),
    ]


def tiny(**options) -> LLM:
    return LLM(model="tiny", max_model_len=64, num_threads=1, **options)


def reply(prompt: list[int], max_tokens: int) -> list[int]:
    """The tiny model's greedy reply, from a fresh engine of its own."""
    return tiny().generate([prompt], params(max_tokens))[0].token_ids


def test_a_continuing_follow_up_is_sent_with_the_reply_it_continues():
    engine = tiny().engine
    summary = serve(engine, chat())
    records = {r.request_id: r for r in engine.metrics.requests}
    assert set(records) == {"a", "b", "c", "d"}
    for name in "bc":  # never before the request they follow finished
        assert records[name].arrival_time >= records["a"].finished_time
        assert records[name].first_scheduled_time >= records["a"].finished_time
    assert records["b"].prompt_tokens == 3 + 4 + 2
    assert records["c"].prompt_tokens == 2  # not continuing: its own prompt only
    # the tokens each produced are a fresh engine's replies to the prompts it should have
    a = reply([5, 6, 7], 4)
    want = {
        "a": [a],
        "b": [reply([5, 6, 7] + a + [8, 9], 3)],
        "c": [reply([10, 11], 2)],
        "d": [reply([12, 13, 14], 5)],
    }
    assert summary["output_digest"] == output_digest(want)


def test_a_follow_up_arrives_its_delay_after_the_request_it_follows_on_a_virtual_clock():
    engine = tiny(executor="simulated", hardware="cpu-local").engine
    start = engine.now()
    serve(engine, chat())
    records = {r.request_id: r for r in engine.metrics.requests}
    finished = records["a"].finished_time
    assert records["b"].arrival_time == pytest.approx(finished)
    assert records["c"].arrival_time == pytest.approx(finished + 0.25)
    assert records["d"].arrival_time == pytest.approx(start)


def test_the_queue_releases_follow_ups_only_when_their_request_finished():
    queue = ArrivalQueue(chat())
    assert [r.request_id for r in queue.pop_due(0.0)] == ["a", "d"]
    for req in (chat()[0], chat()[3]):
        queue.sent(req)
    assert queue and queue.next_time() is None  # b and c wait for a
    queue.finished("d", [1], now=1.0)
    assert queue.pop_due(10.0) == []
    queue.finished("a", [40, 41], now=2.0)
    b, c = queue.pop_due(2.0), queue.pop_due(2.25)
    assert [r.prompt_token_ids for r in b] == [[5, 6, 7, 40, 41, 8, 9]]
    assert [(r.request_id, r.arrival_time, r.prompt_token_ids) for r in c] == [
        ("c", 2.25, [10, 11])
    ]
    assert not queue


@pytest.mark.parametrize(
    "requests, problem",
    [
        ([WorkloadRequest([5], params(1), after="z", request_id="a")],
         "request 'a' follows 'z', which is not in the workload"),
        ([WorkloadRequest([5], params(1), after="b", request_id="a"),
          WorkloadRequest([5], params(1), after="a", request_id="b")],
         "request 'a' follows itself in a loop"),
        ([WorkloadRequest([5], params(1), request_id="a"),
          WorkloadRequest([5], params(1), request_id="a")],
         "request id 'a' is used twice"),
    ],
)  # fmt: skip
def test_follow_ups_that_could_never_be_sent_are_config_errors(requests, problem):
    with pytest.raises(ConfigError, match=problem):
        ArrivalQueue(requests)


def test_the_http_benchmark_refuses_follow_ups_it_cannot_replay():
    from servelab.lab.bench_serve import replay

    with pytest.raises(ConfigError, match="replays timed arrivals only"):
        asyncio.run(replay("http://127.0.0.1:9", chat(), concurrency=1))
