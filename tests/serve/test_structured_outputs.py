"""Structured outputs through the server: OpenAI's `response_format`, vLLM's
`structured_outputs` and `guided_*`, on completions and chat, streamed and not,
with the official `openai` client. Each output validates and equals the offline
engine's for the same constraint; a bad constraint is a 400 naming the problem,
answered before any engine work, while other clients' requests go on unchanged."""

from __future__ import annotations

import concurrent.futures
import json
import re

import httpx
import jsonschema
import openai
import pytest

from servelab import LLM, SamplingParams
from tests.serve.harness import Running, server_config

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome", "Oslo"]},
        "population": {"type": "integer", "minimum": 0, "maximum": 99999},
        "sights": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,5}$"},
                   "maxItems": 2},  # fmt: skip
    },
    "required": ["city", "population", "sights"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server():
    with Running(server_config("tiny")) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=60, max_retries=0)


@pytest.fixture(scope="module")
def offline():
    return LLM(model="tiny", dtype="float64", max_model_len=256)


def offline_text(offline, prompt: str, constraint: dict, max_tokens: int) -> str:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=constraint)
    return offline.generate([prompt], params)[0].outputs[0].text


def test_json_schema_response_format_in_chat_streamed_and_not(server, client):
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}
    kw = dict(model=server.model_name, messages=MESSAGES, max_tokens=120, temperature=0,
              response_format=fmt)  # fmt: skip
    whole = client.chat.completions.create(**kw)
    text = whole.choices[0].message.content
    assert whole.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)
    streamed = "".join(c.choices[0].delta.content or "" for c in
                       client.chat.completions.create(**kw, stream=True) if c.choices)  # fmt: skip
    assert streamed == text


@pytest.mark.parametrize("fields,kind,spec", [
    ({"structured_outputs": {"regex": r"[a-z]{3}-[0-9]{2}"}}, "regex", r"[a-z]{3}-[0-9]{2}"),
    ({"guided_regex": r"[a-z]{3}-[0-9]{2}"}, "regex", r"[a-z]{3}-[0-9]{2}"),
    ({"structured_outputs": {"choice": ["yes", "no way"]}}, "choice", ["yes", "no way"]),
    ({"guided_choice": ["yes", "no way"]}, "choice", ["yes", "no way"]),
    ({"guided_json": SCHEMA}, "json", SCHEMA),
    ({"structured_outputs": {"grammar": 'root ::= "x" [0-9]{1,3}'}}, "grammar",
     'root ::= "x" [0-9]{1,3}'),
])  # fmt: skip
def test_completions_fields_equal_the_offline_engine(server, client, offline, fields, kind, spec):
    want = offline_text(offline, "hello there", {kind: spec}, 80)
    for stream in (False, True):
        got = client.completions.create(model=server.model_name, prompt="hello there",
                                        max_tokens=80, temperature=0, stream=stream,
                                        extra_body=fields)  # fmt: skip
        text = "".join(c.choices[0].text for c in got if c.choices) if stream else \
            got.choices[0].text  # fmt: skip
        assert text == want
    if kind == "regex":
        assert re.fullmatch(spec, want)
    elif kind == "choice":
        assert want in spec
    elif kind == "json":
        jsonschema.validate(json.loads(want), spec)
    else:
        assert re.fullmatch(r"x[0-9]{1,3}", want)


def test_json_object_response_format(server, client):
    got = client.chat.completions.create(model=server.model_name, messages=MESSAGES,
                                         max_tokens=200, temperature=0,
                                         response_format={"type": "json_object"})  # fmt: skip
    text = got.choices[0].message.content
    assert text.startswith("{")
    if got.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": 3}}}}, "properties must be an object"),
    ({"guided_regex": "(ab"}, "parenthesis is not closed"),
    ({"structured_outputs": {"grammar": 'root ::= "a" nowhere'}}, 'Rule "nowhere" is not defined'),
    ({"guided_json": {"enum": ["y" * 1000] * 200}}, "the limit is"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "not several"),
    ({"response_format": {"type": "xml"}}, "one of text, json_object, json_schema"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "not supported"),
    ({"structured_outputs": {"bogus": "a"}}, "unknown field 'bogus'"),
]  # fmt: skip


@pytest.mark.parametrize("fields,message", BAD)
def test_a_bad_constraint_is_a_400_naming_it(server, fields, message):
    r = httpx.post(server.url + "/v1/completions",
                   json={"prompt": "hi", "max_tokens": 4, **fields}, timeout=30)  # fmt: skip
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"]


def test_bad_constraints_leave_concurrent_traffic_alone(server, offline):
    """Plain requests run while bad constraints arrive between them: every plain
    request gets the tokens it gets alone, nothing is left queued."""
    want = offline.generate(["the quick brown fox"], SamplingParams(temperature=0, max_tokens=12,
                                                                    ignore_eos=True))[0]  # fmt: skip
    plain = {"prompt": "the quick brown fox", "max_tokens": 12, "temperature": 0,
             "ignore_eos": True}  # fmt: skip

    def send(body):
        return httpx.post(server.url + "/v1/completions", json=body, timeout=60)

    bodies = []
    for i in range(12):
        bodies.append(plain)
        bodies.append({"prompt": "hi", "max_tokens": 4, **BAD[i % len(BAD)][0]})
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(send, bodies))
    for body, r in zip(bodies, answers):
        if body is plain:
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == want.token_ids
        else:
            assert r.status_code == 400, r.text
    assert server.aengine.num_pending == 0
    assert not server.aengine.engine.groups


def test_metrics_show_the_grammars(server, client):
    client.completions.create(model=server.model_name, prompt="a", max_tokens=6, temperature=0,
                              extra_body={"guided_choice": ["up", "down"]})  # fmt: skip
    text = httpx.get(server.url + "/metrics", timeout=30).text
    for name in ("servelab_grammar_compiles_total", "servelab_grammar_cache_hits_total",
                 "servelab_grammar_compile_seconds_total", "servelab_grammar_mask_seconds_total",
                 "servelab_grammar_waiting"):  # fmt: skip
        assert re.search(rf"^{name}(\{{[^}}]*\}})? [0-9.e+]+$", text, re.M), name


@pytest.fixture(scope="module")
def trained_folder(tmp_path_factory):
    """A trained (briefly: `spec_pair.py --quick`) Qwen3 on Python source, with its
    own 4,096-id byte-level BPE: a real tokenizer and weights that are not random."""
    from tests.benchmark_scripts import load_benchmark

    spec_pair = load_benchmark("spec_pair")
    folder = tmp_path_factory.mktemp("trained") / "run"
    with pytest.MonkeyPatch.context() as mp, spec_pair.torch_threads(spec_pair.QUICK.threads):
        mp.setenv("SERVELAB_CPU_KERNEL", "0")
        spec_pair.train(spec_pair.QUICK, 0, folder)
    return folder / "target"


CHECKS = {
    "json": lambda text: jsonschema.validate(json.loads(text), SCHEMA),
    "regex": lambda text: re.fullmatch(r"[a-z]{3}-[0-9]{2}", text) or pytest.fail(text),
    "choice": lambda text: text in ("yes", "no way") or pytest.fail(text),
    "grammar": lambda text: re.fullmatch(r"x[0-9]{1,3}", text) or pytest.fail(text),
}
SPECS = {"json": SCHEMA, "regex": r"[a-z]{3}-[0-9]{2}", "choice": ["yes", "no way"],
         "grammar": 'root ::= "x" [0-9]{1,3}'}  # fmt: skip


def test_a_trained_model_follows_every_kind_offline_and_served(trained_folder):
    """Offline and through the openai client (streamed and not), greedy and
    sampled: every output of every kind completes and validates, and the served
    greedy text equals the offline one."""
    prompts = ["def parse(text):\n    return ", "import json\nconfig = "]
    offline = LLM(model=str(trained_folder), dtype="float64", max_model_len=256)
    with Running(server_config({"path": str(trained_folder)})) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", timeout=60,
                               max_retries=0)  # fmt: skip
        for kind, spec in SPECS.items():
            for temperature in (0.0, 0.8):
                params = SamplingParams(temperature=temperature, seed=5, max_tokens=100,
                                        structured_outputs={kind: spec})  # fmt: skip
                outs = offline.generate(prompts, params)
                for out in outs:
                    assert out.finish_reason == "stop", (kind, out.outputs[0].text)
                    CHECKS[kind](out.text)
                for stream in (False, True):
                    got = client.completions.create(
                        model=s.model_name, prompt=prompts[0], max_tokens=100,
                        temperature=temperature, seed=5, stream=stream,
                        extra_body={"structured_outputs": {kind: spec}})  # fmt: skip
                    text = ("".join(c.choices[0].text for c in got if c.choices)
                            if stream else got.choices[0].text)  # fmt: skip
                    CHECKS[kind](text)
                    assert text == outs[0].text  # greedy or seeded: the offline engine's
