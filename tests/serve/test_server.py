"""The server through the official `openai` client and raw HTTP: completions and
chat, streamed and not, n=2, stop strings, logprobs, usage; and every error case
(400 naming the field, 401, 429, 500) with the server serving on afterwards."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from servelab import LLM, SamplingParams
from tests.serve.harness import Running, boundary_stop, server_config

PROMPTS = ["hello world", "the quick brown fox", "caf\u00e9 r\u00e9sum\u00e9 \u65e5\u672c"]


@pytest.fixture(scope="module")
def server(model_folder):
    with Running(server_config({"path": str(model_folder)}, {"max_queued_requests": 8})) as s:
        yield s


@pytest.fixture(scope="module")
def offline(model_folder):
    return LLM(model={"path": str(model_folder)}, dtype="float64", max_model_len=256)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=60, max_retries=0)


def wait_idle(server, timeout=20.0) -> None:
    """Until the engine holds no request and no block (bounded)."""
    deadline = time.monotonic() + timeout
    alloc = server.engine.allocator
    while server.aengine.num_pending or alloc.num_free_blocks != alloc.num_blocks:
        assert time.monotonic() < deadline, "requests or blocks still held"
        time.sleep(0.02)


def greedy(n=1, **kw):
    return SamplingParams(
        **{"temperature": 0.0, "max_tokens": 12, "ignore_eos": True, "n": n, **kw}
    )


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [server.model_name]
    assert httpx.get(server.url + "/health", timeout=10).json() == {"status": "ok"}


def test_completions_equal_the_offline_run(server, client, offline):
    want = offline.generate(PROMPTS, greedy())
    got = client.completions.create(model=server.model_name, prompt=PROMPTS, max_tokens=12,
                                    temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
    assert [c.index for c in got.choices] == [0, 1, 2]
    assert [c.token_ids for c in got.choices] == [o.token_ids for o in want]
    assert [c.text for c in got.choices] == [o.text for o in want]
    assert got.usage.completion_tokens == 36
    assert got.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in want)
    ids = client.completions.create(model=server.model_name, prompt=want[0].prompt_token_ids,
                                    max_tokens=12, temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
    assert ids.choices[0].token_ids == want[0].token_ids
    wait_idle(server)


def test_streamed_completion_equals_the_whole_one(server, client, offline):
    want = offline.generate(PROMPTS[2], greedy())[0]
    chunks = list(client.completions.create(
        model=server.model_name, prompt=PROMPTS[2], max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))  # fmt: skip
    pieces = [c.choices[0] for c in chunks if c.choices]
    assert sum((p.token_ids for p in pieces), []) == want.token_ids
    assert "".join(p.text for p in pieces) == want.text
    assert all(p.token_ids for p in pieces)  # one chunk per engine step with tokens
    assert pieces[-1].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 12 and not chunks[-1].choices


def test_n2_seeded_samples_equal_offline(server, client, offline):
    params = SamplingParams(temperature=0.9, seed=3, n=2, max_tokens=8, ignore_eos=True)
    want = offline.generate(PROMPTS[0], params)[0]
    got = client.completions.create(model=server.model_name, prompt=PROMPTS[0], n=2, seed=3,
                                    temperature=0.9, max_tokens=8, extra_body={"ignore_eos": True})  # fmt: skip
    assert [c.token_ids for c in got.choices] == [c.token_ids for c in want.outputs]
    assert got.choices[0].token_ids != got.choices[1].token_ids


def test_stop_strings_streamed_and_not(server, client, offline):
    full = offline.generate(PROMPTS[1], greedy())[0]
    stop, _ = boundary_stop(offline.engine.tokenizer, full.token_ids)
    want = offline.generate(PROMPTS[1], greedy(stop=[stop]))[0]
    assert want.finish_reason == "stop" and len(want.token_ids) < 12
    kw = dict(model=server.model_name, prompt=PROMPTS[1], max_tokens=12, temperature=0,
              stop=[stop], extra_body={"ignore_eos": True})  # fmt: skip
    got = client.completions.create(**kw).choices[0]
    assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids, "stop")
    pieces = [c.choices[0] for c in client.completions.create(stream=True, **kw) if c.choices]
    assert "".join(p.text for p in pieces) == want.text
    assert stop not in "".join(p.text for p in pieces)


def test_completion_logprobs(server, client, offline):
    want = offline.generate(PROMPTS[0], greedy(logprobs=2))[0].outputs[0].logprobs
    got = client.completions.create(model=server.model_name, prompt=PROMPTS[0], max_tokens=12,
                                    temperature=0, logprobs=2, extra_body={"ignore_eos": True})  # fmt: skip
    lp = got.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([e["logprob"] for e in want])
    assert all(len(t) <= 2 for t in lp.top_logprobs) and len(lp.tokens) == 12


def test_chat_streamed_and_not(server, client, offline):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    prompt = "<|system|>be brief\n<|user|>hello\n<|assistant|>"
    ids = offline.engine.tokenizer.encode(prompt, add_special_tokens=False).ids
    want = offline.generate([ids], greedy())[0]
    kw = dict(model=server.model_name, messages=messages, max_tokens=12, temperature=0,
              extra_body={"ignore_eos": True})  # fmt: skip
    got = client.chat.completions.create(logprobs=True, top_logprobs=1, **kw)
    assert got.choices[0].message.content == want.text
    assert got.choices[0].message.role == "assistant"
    assert len(got.choices[0].logprobs.content) == 12
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_without_a_template_is_a_400(bare_folder):
    with Running(server_config({"path": str(bare_folder)})) as s:
        r = httpx.post(s.url + "/v1/chat/completions", timeout=10,
                       json={"messages": [{"role": "user", "content": "hi"}]})  # fmt: skip
    assert r.status_code == 400
    assert "no chat template" in r.json()["error"]["message"]


BAD = [
    (b"{not json", None),
    (b'{"prompt": "hi", "bogus": 1}', "bogus"),
    (b'{"prompt": "hi", "max_tokens": "3"}', "max_tokens"),
    (b'{"prompt": "hi", "temperature": -1}', "temperature"),
    (b'{"prompt": "hi", "top_p": 0}', "top_p"),
    (b'{"prompt": "hi", "n": 99}', "n"),
    (b'{"prompt": "hi", "max_tokens": 0}', "max_tokens"),
    (b'{"prompt": "' + b"hello " * 400 + b'"}', "prompt"),
    (b'{"prompt": [1, 2, 100000]}', "prompt"),
    (b'{"prompt": "hi", "stop_token_ids": [100000]}', "stop_token_ids"),
    (b'{"max_tokens": 3}', "prompt"),
]


@pytest.mark.parametrize("body,param", BAD)
def test_bad_requests_are_400_naming_the_field(server, body, param):
    r = httpx.post(server.url + "/v1/completions", content=body, timeout=10,
                   headers={"content-type": "application/json"})  # fmt: skip
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert error["message"]


def test_wrong_api_key_is_401_and_reaches_no_engine_code(model_folder, monkeypatch):
    with Running(server_config({"path": str(model_folder)}, {"api_key": "sekret"})) as s:

        def boom(*a, **k):
            raise AssertionError("the engine was reached")

        monkeypatch.setattr(s.aengine, "add", boom)
        for headers in ({}, {"authorization": "Bearer wrong"}):
            r = httpx.post(s.url + "/v1/completions", json={"prompt": "hi"}, headers=headers,
                           timeout=10)  # fmt: skip
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        monkeypatch.undo()
        good = openai.OpenAI(base_url=s.url + "/v1", api_key="sekret", timeout=30, max_retries=0)
        assert good.completions.create(model=s.model_name, prompt="hi", max_tokens=2).choices[0].token_ids


def slow_steps(monkeypatch, server, seconds: float = 0.05) -> None:
    """Each step sleeps a little, so a long request is surely still running."""
    executor = server.engine.executor  # a step goes through its execute
    real = executor.execute

    def slow(plan):
        time.sleep(seconds)
        return real(plan)

    monkeypatch.setattr(executor, "execute", slow)


def test_a_response_that_does_not_stream_outlasts_slow_steps(server, client, offline,
                                                             monkeypatch):  # fmt: skip
    # slow steps: waiting for the next token must not cancel it
    slow_steps(monkeypatch, server, seconds=0.5)
    want = offline.generate(PROMPTS[0], greedy(max_tokens=3))[0]
    got = client.completions.create(model=server.model_name, prompt=PROMPTS[0], max_tokens=3,
                                    temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
    assert got.choices[0].token_ids == want.token_ids and got.choices[0].text == want.text
    assert got.choices[0].finish_reason == "length"


def test_disconnect_mid_stream_aborts_and_frees(server, client, monkeypatch):
    slow_steps(monkeypatch, server)
    body = {"prompt": "hello", "max_tokens": 200, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", server.url + "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data:"))
            assert "token_ids" in first
    wait_idle(server)
    aborted = [r for r in server.engine.metrics.requests if r.finish_reason == "abort"]
    assert aborted and aborted[-1].output_tokens < 200
    assert client.completions.create(model=server.model_name, prompt="hi", max_tokens=3).choices[0].token_ids


def held_steps(monkeypatch, server) -> threading.Event:
    """Steps after the first wait for the returned event, so a long request is
    surely still running, however slow or fast the machine is."""
    executor = server.engine.executor  # a step goes through its execute
    real = executor.execute
    release = threading.Event()
    steps = []

    def held(plan):
        steps.append(1)
        if len(steps) > 1:
            assert release.wait(60), "the test never released the held steps"
        return real(plan)

    monkeypatch.setattr(executor, "execute", held)
    return release


def test_full_queue_is_429_then_serves_again(model_folder, monkeypatch):
    with Running(server_config({"path": str(model_folder)}, {"max_queued_requests": 1})) as s:
        release = held_steps(monkeypatch, s)
        body = {"prompt": "hello", "max_tokens": 200, "stream": True, "ignore_eos": True}
        with httpx.Client(timeout=30) as http:
            with http.stream("POST", s.url + "/v1/completions", json=body) as r:
                next(line for line in r.iter_lines() if line.startswith("data:"))
                # the long request holds the one place (checked, not assumed)
                assert s.aengine.num_pending == 1, "the long request already ended"
                full = http.post(s.url + "/v1/completions", json={"prompt": "hi"})
                ended = [(r.request_id, r.finish_reason, r.output_tokens)
                         for r in s.engine.metrics.requests]  # fmt: skip
                assert full.status_code == 429, (full.status_code, s.aengine.num_pending, ended)
                assert "full" in full.json()["error"]["message"]
                release.set()
        wait_idle(s)
        assert (
            httpx.post(s.url + "/v1/completions", json={"prompt": "hi"}, timeout=30).status_code
            == 200
        )


def test_engine_failure_is_500_for_the_touched_request_only(server, client, monkeypatch):
    executor = server.engine.executor  # a step goes through its execute
    real = executor.execute
    calls = []

    def fail_once(plan):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("kernel exploded")
        return real(plan)

    monkeypatch.setattr(executor, "execute", fail_once)
    with pytest.raises(openai.InternalServerError, match="the request failed in the engine") as e:
        client.completions.create(model=server.model_name, prompt="hi", max_tokens=3)
    assert "kernel exploded" not in str(e.value)  # internals go to the server's log only
    assert client.completions.create(model=server.model_name, prompt="hi", max_tokens=3).choices[0].token_ids
    wait_idle(server)


def test_metrics_count_requests_and_blocks(server, client):
    client.completions.create(model=server.model_name, prompt="hi", max_tokens=3)
    text = httpx.get(server.url + "/metrics", timeout=10).text
    for name in ("servelab_requests_running", "servelab_kv_blocks_free",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds",
                 "vllm:e2e_request_latency_seconds", 'servelab_preemptions_total{kind="swap"}',
                 "servelab_prefix_cache_hit_rate", "vllm:generation_tokens_total"):  # fmt: skip
        assert name in text
    assert "servelab_kv_blocks_used 0.0" in text
