"""The engine's one loop: `LLM.generate` and the asyncio front end submit through
the same `EngineLoop`. Offline, the calling thread steps (no other thread runs a
step); with the background thread running, that thread steps every request,
`generate`'s included, and the tokens are the ones a plain run gives. A request
finished by any route (an abort from a hook during a step) reaches its caller once; stopping
the background thread aborts only the asyncio requests, and a waiting
`generate` goes on driving the loop itself."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from servelab import LLM, SamplingParams, hookimpl
from servelab.engine.engine import Events
from servelab.registry.plugin_manager import get_plugin_manager
from servelab.serve.async_engine import AsyncEngine
from tests.engine.engine_checks import assert_engine_clean

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = [[3 + i, 9, 4 + 2 * i, 7, 5] for i in range(6)]


@contextlib.contextmanager
def on_step_end(callback: Callable[[], None]) -> Iterator[None]:
    """A plugin implementing `servelab_step_end`, registered after the engine was built
    (the engine asks pluggy's live list, so it is called) and unregistered after."""

    class StepObserver:
        @hookimpl
        def servelab_step_end(self, engine, step):
            callback()

    manager = get_plugin_manager()
    plugin = manager.register(StepObserver(), name="step-observer")
    try:
        yield
    finally:
        manager.unregister(name=plugin)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(model="tiny", max_model_len=64, kv_cache_memory="4MiB")


@pytest.fixture(scope="module")
def plain(llm) -> list[list[int]]:
    """Each prompt's tokens from the engine's own step loop, without the EngineLoop."""
    engine, tokens = llm.engine, []
    for prompt in PROMPTS:
        engine.add_request(prompt, GREEDY, request_id="plain")
        while engine.has_unfinished():
            for out in engine.step():
                tokens.append(out.token_ids)
    return tokens


@pytest.fixture
def stepping_threads(llm):
    """The names of the threads that ran each of the loop's steps."""
    names: list[str] = []
    llm.loop.on_step = lambda: names.append(threading.current_thread().name)
    yield names
    llm.loop.on_step = None


def test_offline_generate_steps_on_the_calling_thread(llm, plain, stepping_threads):
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == plain
    assert stepping_threads and set(stepping_threads) == {threading.current_thread().name}
    assert_engine_clean(llm)


def test_generate_while_the_background_loop_runs_is_stepped_by_it(llm, plain, stepping_threads):
    aengine = AsyncEngine(llm.loop)
    aengine.start()
    try:
        outs = llm.generate(PROMPTS, GREEDY)
    finally:
        aengine.stop()
    assert [o.token_ids for o in outs] == plain
    assert stepping_threads and set(stepping_threads) == {"servelab-engine"}
    assert llm.loop.num_pending == 0
    assert_engine_clean(llm)


def test_streams_and_generate_share_the_steps_and_keep_their_tokens(llm, plain):
    aengine = AsyncEngine(llm.loop)
    aengine.start()
    results: dict[str, list] = {}

    def offline() -> None:
        results["generate"] = [o.token_ids for o in llm.generate(PROMPTS[3:], GREEDY)]

    async def stream(i: int) -> list[int]:
        tokens: list[int] = []
        async for delta in aengine.generate(f"s{i}", PROMPTS[i], GREEDY):
            tokens += delta.new_tokens.get(0, [])
            if delta.finished:
                assert delta.output.token_ids == tokens  # the deltas add up to the output
        return tokens

    async def both() -> list[list[int]]:
        thread = threading.Thread(target=offline)
        thread.start()
        streamed = await asyncio.wait_for(asyncio.gather(*(stream(i) for i in range(3))), 60)
        await asyncio.to_thread(thread.join, 60)
        return list(streamed)

    try:
        streamed = asyncio.run(both())
    finally:
        aengine.stop()
    assert streamed == plain[:3] and results["generate"] == plain[3:]
    assert llm.loop.num_pending == 0
    assert_engine_clean(llm)


def test_an_event_is_sent_only_while_a_plugin_implements_it(llm, monkeypatch):
    sent: list[str] = []
    notify = llm.engine.events.notify
    monkeypatch.setattr(
        llm.engine.events, "notify", lambda hook, **kw: (sent.append(hook), notify(hook, **kw))
    )
    llm.generate(PROMPTS[:1], GREEDY)
    assert "servelab_step_end" not in sent  # no plugin implements it: no call, no record copy
    with on_step_end(lambda: None):
        llm.generate(PROMPTS[:1], GREEDY)
    assert sent.count("servelab_step_end") == GREEDY.max_tokens  # one per step


def test_the_engines_one_event_channel_asks_before_it_calls():
    calls: list[int] = []
    quiet = Events()  # no plugin manager: nothing is listened to, notify does nothing
    assert not quiet.listened("servelab_step_end")
    quiet.notify("servelab_step_end", engine=None, step={})
    events = Events(get_plugin_manager())
    assert not events.listened("servelab_step_end")
    with on_step_end(lambda: calls.append(1)):
        assert events.listened("servelab_step_end")
        events.notify("servelab_step_end", engine=None, step={})
    assert calls == [1] and not events.listened("servelab_step_end")


def test_a_request_aborted_by_a_hook_comes_back_as_aborted(llm, plain):
    engine = llm.engine
    aborted: list[str] = []

    def abort_the_second_after_a_step():
        if not aborted:
            aborted.append([r for r in engine.groups if r.startswith("gen-")][1])
            engine.abort(aborted[0])

    with on_step_end(abort_the_second_after_a_step):
        outs = llm.generate(PROMPTS[:3], GREEDY)
    assert aborted
    assert [o.finish_reason for o in outs] == ["length", "abort", "length"]
    assert outs[0].token_ids == plain[0] and outs[2].token_ids == plain[2]
    assert outs[1].token_ids == plain[1][: len(outs[1].token_ids)]
    assert_engine_clean(llm)


def test_stopping_the_background_aborts_streams_but_generate_finishes(llm, plain, monkeypatch):
    engine = llm.engine
    execute = engine.executor.execute

    def slow(plan):
        time.sleep(0.02)
        return execute(plan)

    def generate_is_running() -> bool:
        deadline = time.monotonic() + 30
        while not any(r.startswith("gen-") for r in list(engine.groups)):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    monkeypatch.setattr(engine.executor, "execute", slow)
    long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    aengine = AsyncEngine(llm.loop)
    aengine.start()
    results: dict[str, list] = {}
    thread = threading.Thread(
        target=lambda: results.setdefault("outs", llm.generate(PROMPTS[:2], GREEDY))
    )

    async def scenario() -> str:
        stream = aengine.generate("long", PROMPTS[5], long)
        first = await asyncio.wait_for(stream.__anext__(), 30)
        assert not first.finished
        thread.start()
        assert await asyncio.to_thread(generate_is_running)  # stepped by the background
        await asyncio.to_thread(aengine.stop)  # the stream is aborted; generate drives on
        async for delta in stream:
            if delta.finished:
                return delta.output.finish_reason
        return "no final delta"

    assert asyncio.run(scenario()) == "abort"
    thread.join(60)
    assert not thread.is_alive()
    assert [o.token_ids for o in results["outs"]] == plain[:2]
    assert llm.loop.num_pending == 0
    assert_engine_clean(llm)


def test_a_hook_abort_during_a_step_is_among_that_steps_outputs(llm, plain):
    """The engine alone, no loop: every finished request comes back from `step`."""
    engine = llm.engine
    aborted: list = []

    def abort_b_after_the_first_step():
        if not aborted:
            aborted.append(engine.abort("b"))

    engine.add_request(PROMPTS[0], GREEDY, request_id="a")
    engine.add_request(PROMPTS[1], GREEDY, request_id="b")
    with on_step_end(abort_b_after_the_first_step):
        first = engine.step()
    assert [o.request_id for o in first] == ["b"] and first[0] is aborted[0]
    assert first[0].finish_reason == "abort"
    rest = []
    while engine.has_unfinished():
        rest += engine.step()
    assert [(o.request_id, o.token_ids) for o in rest] == [("a", plain[0])]
    assert_engine_clean(llm)
