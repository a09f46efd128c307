"""The request surface and conventions of vLLM's OpenAI server, as its clients and
benchmarks use them: the fields `vllm bench serve` always sends, content-part
arrays, assistant `content: null`, `stream_options.continuous_usage_stats`, the
sampling fields (equal to the offline API), fields servelab does not implement
(a 400 saying so), unknown model 404, max_tokens rules, one choice per chunk,
OpenAI's error shape on unknown routes, /version /ping /tokenize /detokenize and
a template kept in chat_template.jinja."""

from __future__ import annotations

import json

import httpx
import pytest

from servelab import LLM, SamplingParams
from tests.serve.harness import CHAT_TEMPLATE, Running, server_config, text_model_folder

MAX_LEN = 256


@pytest.fixture(scope="module")
def jinja_folder(tmp_path_factory):
    """A folder keeping its chat template in chat_template.jinja only."""
    folder = text_model_folder(tmp_path_factory.mktemp("jinja-model"), chat_template=False)
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return folder


@pytest.fixture(scope="module")
def server(jinja_folder):
    with Running(server_config({"path": str(jinja_folder)})) as s:
        yield s


@pytest.fixture(scope="module")
def offline(jinja_folder):
    return LLM(model={"path": str(jinja_folder)}, dtype="float64", max_model_len=MAX_LEN)


def post(server, path, body, **kw):
    return httpx.post(server.url + path, json=body, timeout=60, **kw)


def sse(server, path, body) -> list[dict]:
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", server.url + path, json=body) as r:
            lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_vllm_bench_payloads_are_accepted(server):
    # exactly what `vllm bench serve --backend openai` and `openai-chat` send
    r = post(server, "/v1/completions", {"model": server.model_name, "prompt": "hello world",
             "repetition_penalty": 1.0, "max_tokens": 4, "logprobs": None, "stream": True,
             "stream_options": {"include_usage": True}, "ignore_eos": True})  # fmt: skip
    assert r.status_code == 200 and r.text.rstrip().endswith("[DONE]"), r.text
    r = post(server, "/v1/chat/completions", {"model": server.model_name, "messages": [
             {"role": "user", "content": [{"type": "text", "text": "hello world"}]}],
             "max_completion_tokens": 4, "stream": True,
             "stream_options": {"include_usage": True}, "ignore_eos": True})  # fmt: skip
    assert r.status_code == 200 and r.text.rstrip().endswith("[DONE]"), r.text


def test_content_parts_and_null_assistant_content_render_as_vllm_does(server, offline):
    parts = [{"role": "user", "content": [{"type": "text", "text": "hello"},
                                          {"type": "text", "text": "world"}]},
             {"role": "assistant", "content": None}, {"role": "user", "content": "fox"}]  # fmt: skip
    text = "<|user|>hello\nworld\n<|assistant|>\n<|user|>fox\n<|assistant|>"
    want = offline.generate([text], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    r = post(server, "/v1/chat/completions", {"messages": parts, "max_tokens": 6,
             "temperature": 0, "ignore_eos": True})  # fmt: skip
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == want[0].token_ids


def test_continuous_usage_stats_in_every_chunk(server):
    chunks = sse(server, "/v1/completions", {"prompt": "hello", "max_tokens": 5, "stream": True,
                 "ignore_eos": True, "stream_options": {"include_usage": True,
                 "continuous_usage_stats": True}})  # fmt: skip
    assert all("usage" in c for c in chunks)
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 5


@pytest.mark.parametrize("fields", [
    dict(repetition_penalty=1.7), dict(frequency_penalty=1.5, presence_penalty=0.5),
    dict(min_tokens=8, logit_bias={"7": 5.0}),
])  # fmt: skip
def test_sampling_fields_equal_the_offline_api(server, offline, fields):
    params = {k: ({int(t): b for t, b in v.items()} if k == "logit_bias" else v)
              for k, v in fields.items()}  # fmt: skip
    want = offline.generate(["the quick brown fox"],
                            SamplingParams(temperature=0, max_tokens=8, **params))[0]  # fmt: skip
    r = post(server, "/v1/completions", {"prompt": "the quick brown fox", "max_tokens": 8,
             "temperature": 0, **fields})  # fmt: skip
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == want.token_ids


@pytest.mark.parametrize("fields,param", [
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"structured_outputs": {"regex": "a", "structural_tag": "x"}},
     "structured_outputs.structural_tag"),
    ({"best_of": 3}, "best_of"), ({"suffix": "x"}, "suffix"),
])  # fmt: skip
def test_unimplemented_fields_say_not_supported(server, fields, param):
    r = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, **fields})
    assert r.status_code == 400
    error = r.json()["error"]
    assert "not supported by servelab" in error["message"] and error["param"] == param


def test_unknown_model_is_404_and_unknown_route_has_the_openai_shape(server):
    r = post(server, "/v1/completions", {"model": "nope", "prompt": "hi"})
    served = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    message = r.json()["error"]["message"]
    assert r.status_code == 404 and "does not exist" in message
    assert f"this server serves `{served}`" in message  # the name to send instead
    r = httpx.get(server.url + "/v1/nowhere", timeout=10)
    assert r.status_code == 404 and set(r.json()["error"]) >= {"message", "type", "code"}


def test_max_tokens_rules(server):
    r = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": MAX_LEN + 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = post(server, "/v1/completions", {"prompt": [5, 6, 7, 8], "max_tokens": MAX_LEN,
             "ignore_eos": True})  # fmt: skip
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert len(choice["token_ids"]) == MAX_LEN - 4 and choice["finish_reason"] == "length"
    # chat's default: the rest of the context
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
             "ignore_eos": True})  # fmt: skip
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == MAX_LEN


def test_n2_stream_sends_one_choice_per_chunk(server):
    chunks = sse(server, "/v1/completions", {"prompt": "hello", "max_tokens": 4, "n": 2,
                 "temperature": 1.0, "seed": 3, "stream": True, "ignore_eos": True})  # fmt: skip
    assert chunks and all(len(c["choices"]) == 1 for c in chunks)
    assert {c["choices"][0]["index"] for c in chunks} == {0, 1}


def test_version_ping_tokenize_detokenize(server, offline):
    assert httpx.get(server.url + "/version", timeout=10).json()["version"]
    assert httpx.get(server.url + "/ping", timeout=10).status_code == 200
    ids = offline.engine.tokenizer.encode("hello world").ids
    r = post(server, "/tokenize", {"prompt": "hello world"}).json()
    assert r["tokens"] == ids and r["count"] == len(ids) and r["max_model_len"] == MAX_LEN
    assert post(server, "/detokenize", {"tokens": ids}).json()["prompt"] == "hello world"


def test_echo_with_logprobs_gives_the_prompts_logprobs_as_vllm(server, offline):
    """vLLM's shape: the prompt's tokens then the output's, the first token's logprob
    and top None, text offsets from the start of the echoed prompt (each token's
    text long); the values are the offline API's prompt_logprobs and logprobs."""
    body = {"prompt": "hello world", "max_tokens": 4, "temperature": 0, "logprobs": 2,
            "echo": True, "ignore_eos": True}  # fmt: skip
    r = post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2,
                            prompt_logprobs=2)  # fmt: skip
    out = offline.generate(["hello world"], params)[0]
    tok = offline.engine.tokenizer
    ids = out.prompt_token_ids + out.token_ids
    entries = out.prompt_logprobs + out.outputs[0].logprobs
    texts = [tok.decode([t]) for t in ids]
    assert choice["text"] == tok.decode(out.prompt_token_ids) + out.text
    lp = choice["logprobs"]
    assert lp["tokens"] == texts
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == pytest.approx([e["logprob"] for e in entries[1:]])
    assert [list(top) for top in lp["top_logprobs"][1:]] == [
        list(dict.fromkeys(tok.decode([t]) for t, _ in e["top"])) for e in entries[1:]
    ]
    assert lp["text_offset"] == [sum(len(t) for t in texts[:i]) for i in range(len(texts))]
    # streamed: the prompt's chunk first, with its logprobs; the same tokens and values
    chunks = [c["choices"][0] for c in sse(server, "/v1/completions", {**body, "stream": True})]
    first = chunks[0]["logprobs"]
    assert chunks[0]["text"] == tok.decode(out.prompt_token_ids)
    assert first["tokens"] == texts[: len(out.prompt_token_ids)]
    assert first["text_offset"] == lp["text_offset"][: len(out.prompt_token_ids)]
    streamed = [c["logprobs"] for c in chunks if c["logprobs"]]
    assert sum((s["tokens"] for s in streamed), []) == lp["tokens"]
    assert sum((s["token_logprobs"] for s in streamed), []) == lp["token_logprobs"]
    assert "".join(c["text"] for c in chunks) == choice["text"]
