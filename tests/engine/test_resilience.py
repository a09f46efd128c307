"""The engine is never stuck and never mixes callers up: a step that raises
fails only the requests it touched (finish reason `error`, a message naming the
stage and the part), frees their blocks and the engine goes on; `generate` from
several threads gives every thread exactly its own outputs; arbitrary values in
any request argument are either accepted or a RequestError, and the next
well-formed `generate` returns the right tokens."""

from __future__ import annotations

import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from servelab import LLM, RequestError, SamplingParams
from tests.engine.engine_checks import assert_engine_clean

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
PROMPTS = [[5 + i, 6, 7 + i, 8] for i in range(16)]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(model="tiny", max_model_len=64, kv_cache_memory="4MiB")


@pytest.fixture(scope="module")
def clean(llm) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


# -- a step that raises


def test_a_failing_forward_fails_only_the_requests_of_that_step(llm, clean, monkeypatch):
    engine = llm.engine
    engine.add_request(PROMPTS[0], GREEDY, request_id="before")
    engine.step()  # "before" has its prompt in the cache: it decodes from now on
    forward, calls = engine.backend.forward, []

    def broken(*args):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("a kernel fell over")
        return forward(*args)

    monkeypatch.setattr(engine.backend, "forward", broken)
    failed = engine.step()  # the step that raises: it touched "before" only
    assert [o.request_id for o in failed] == ["before"]
    assert failed[0].finish_reason == "error"
    assert "the model forward" in failed[0].error and "a kernel fell over" in failed[0].error
    assert "attention 'per_request'" in failed[0].error
    assert_engine_clean(llm)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == clean  # it goes on


def test_a_scheduler_that_raises_fails_every_request_and_the_next_call_works(
    llm, clean, monkeypatch
):
    engine = llm.engine
    schedule, calls = engine.scheduler.schedule, []

    def broken():
        calls.append(1)
        if len(calls) == 2:
            raise ValueError("a scheduler bug")
        return schedule()

    monkeypatch.setattr(engine.scheduler, "schedule", broken)
    outs = llm.generate(PROMPTS[:3], GREEDY)  # returns: one output per prompt
    assert [o.finish_reason for o in outs] == ["error"] * 3
    assert all("scheduler.schedule (scheduler 'continuous')" in o.error for o in outs)
    assert all("ValueError: a scheduler bug" in o.error for o in outs)
    assert_engine_clean(llm)
    monkeypatch.undo()
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == clean


# -- several threads on one LLM


def test_eight_threads_each_get_their_own_outputs(llm):
    prompt_sets = [
        [[(t * 37 + i * 11 + j) % 500 + 2 for j in range(3 + i % 5)] for i in range(16)]
        for t in range(8)
    ]
    expected = [[o.token_ids for o in llm.generate(p, GREEDY)] for p in prompt_sets]
    for _ in range(20):
        results: dict[int, list[list[int]]] = {}
        errors: list[BaseException] = []

        def run(t: int, results=results, errors=errors) -> None:
            try:
                results[t] = [o.token_ids for o in llm.generate(prompt_sets[t], GREEDY)]
            except BaseException as exc:  # reported below, not lost in the thread
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(t,)) for t in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert not errors and not any(t.is_alive() for t in threads)
        assert [results[t] for t in range(8)] == expected
    assert_engine_clean(llm)


# -- arbitrary values


anything = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=4) | st.tuples(inner, inner),
    max_leaves=6,
)
FIELDS = [
    "temperature",
    "top_k",
    "top_p",
    "max_tokens",
    "n",
    "seed",
    "stop_token_ids",
    "ignore_eos",
]


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    field=st.sampled_from(FIELDS + ["prompt", "priority", "arrival_time", "request_id"]),
    value=anything,
)
def test_arbitrary_values_are_accepted_or_a_request_error(llm, clean, field, value):
    engine = llm.engine
    try:
        if field in FIELDS:
            options = {"temperature": 0.0, "max_tokens": 3, "ignore_eos": True, field: value}
            outs = llm.generate([PROMPTS[0], PROMPTS[1]], [GREEDY, SamplingParams(**options)])
            assert outs[0].token_ids == clean[0]
            assert outs[1].error is None or outs[1].finish_reason == "rejected"
        elif field == "prompt":
            outs = llm.generate([PROMPTS[0], value], GREEDY)
            assert outs[0].token_ids == clean[0]
        else:
            engine.add_request(PROMPTS[1], GREEDY, **{field: value})
            while engine.has_unfinished():
                engine.step()
    except RequestError:
        pass
    llm.loop.take_finished()
    assert_engine_clean(llm)
    assert llm.generate([PROMPTS[2]], GREEDY)[0].token_ids == clean[2]
