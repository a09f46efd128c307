"""The client id end to end (add_request, the trace, the records) and the
multi_client and multi_turn workloads."""

from __future__ import annotations

import json

import pytest

from servelab import LLM, SamplingParams
from servelab.errors import ConfigError
from servelab.lab.runner import serve
from servelab.lab.workload import make_workload

VOCAB = 512


def clients(**overrides):
    heavy = {
        "name": "heavy",
        "rate": 20.0,
        "prompt_len": 8,
        "output_len": 4,
        "start": 0.0,
        "stop": 2.0,
    }
    light = {
        "name": "light",
        "rate": 5.0,
        "prompt_len": 6,
        "output_len": 3,
        "start": 1.0,
        "stop": 2.0,
    }
    light.update(overrides)
    return [heavy, light]


def test_multi_client_streams_keep_their_clients_windows_and_rates():
    requests = make_workload({"name": "multi_client", "clients": clients(), "seed": 3}, VOCAB)
    times = [r.arrival_time for r in requests]
    assert times == sorted(times)
    by = {name: [r for r in requests if r.client == name] for name in ("heavy", "light")}
    assert by["heavy"][0].arrival_time == 0.0 and by["light"][0].arrival_time == 1.0
    assert all(1.0 <= r.arrival_time < 2.0 for r in by["light"])
    assert all(len(r.prompt_token_ids) == 6 and r.params.max_tokens == 3 for r in by["light"])
    # about 40 and 5 requests: the heavy client sends several times as many
    assert len(by["heavy"]) > 2 * len(by["light"]) >= 2
    assert {r.request_id for r in by["light"]} == {f"light-{k}" for k in range(len(by["light"]))}
    again = make_workload({"name": "multi_client", "clients": clients(), "seed": 3}, VOCAB)
    assert [r.prompt_token_ids for r in again] == [r.prompt_token_ids for r in requests]


@pytest.mark.parametrize(
    ("overrides", "problem"),
    [
        ({"rate": 0}, "rate must be a finite number > 0"),
        ({"stop": 0.5}, "stop must be a finite number > start"),
        ({"name": ""}, "name must be a non-empty string"),
        ({"name": "heavy"}, "client 'heavy' is listed twice"),
        ({"colour": 1}, "unknown option 'colour'"),
    ],
)
def test_bad_clients_are_config_errors(overrides, problem):
    with pytest.raises(ConfigError, match=problem):
        make_workload({"name": "multi_client", "clients": clients(**overrides)}, VOCAB)


def test_conversation_turns_resend_the_whole_history():
    node = {"name": "multi_turn", "num_conversations": 3, "turns": 3, "system_prompt_len": 10}
    node.update(message_len=4, output_len=5, think_time=1.0)
    requests = make_workload(node, VOCAB)
    assert len(requests) == 9
    system = requests[0].prompt_token_ids[:10]
    for c in range(3):
        turns = sorted(
            (r for r in requests if r.meta["conversation"] == c), key=lambda r: r.meta["turn"]
        )
        for earlier, later in zip(turns, turns[1:]):
            prompt = earlier.prompt_token_ids
            assert later.prompt_token_ids[: len(prompt)] == prompt  # the history, resent
            assert len(later.prompt_token_ids) == len(prompt) + 5 + 4  # reply stand-in + message
            assert later.arrival_time == pytest.approx(earlier.arrival_time + 1.0)
        assert turns[0].prompt_token_ids[:10] == system  # one system prompt for every chat


def test_closed_loop_turns_follow_the_previous_turn_and_send_only_their_message():
    node = {"name": "multi_turn", "num_conversations": 3, "turns": 3, "system_prompt_len": 10}
    node.update(message_len=4, output_len=5, think_time=0.5, arrival="all_at_once")
    timed = make_workload(node, VOCAB)
    closed = make_workload({**node, "closed_loop": True}, VOCAB)
    assert len(closed) == len(timed) == 9
    by_id = {r.request_id: r for r in timed}
    for req in closed:
        open_loop = by_id[req.request_id]  # the same chats, message for message
        if req.meta["turn"] == 0:
            assert req.after is None and not req.continues and req.arrival_time == 0.0
            assert req.prompt_token_ids == open_loop.prompt_token_ids
        else:
            c, k = req.meta["conversation"], req.meta["turn"]
            assert req.after == f"chat-{c}-turn-{k - 1}" and req.continues
            assert req.prompt_token_ids == open_loop.prompt_token_ids[-4:]  # the new message
            assert req.arrival_time == 0.5  # after the previous reply
    assert [r.after is None for r in closed] == [True] * 3 + [False] * 6  # timed ones first


def test_closed_loop_few_shot_prompts_wait_for_the_previous_one():
    node = {"name": "multi_turn", "variant": "few_shot", "num_conversations": 2, "turns": 2}
    requests = make_workload({**node, "closed_loop": True, "think_time": 0.0}, VOCAB)
    followers = {r.request_id: r.after for r in requests if r.after}
    assert followers == {"fewshot-0-1": "fewshot-0-0", "fewshot-1-1": "fewshot-1-0"}
    assert not any(r.continues for r in requests)  # a whole prompt each: no history to carry


def test_a_conversation_ends_where_it_would_outgrow_the_engine():
    node = {"name": "multi_turn", "num_conversations": 1, "turns": 10, "system_prompt_len": 10}
    requests = make_workload({**node, "message_len": 4, "output_len": 4}, VOCAB, max_model_len=40)
    assert [len(r.prompt_token_ids) for r in requests] == [14, 22, 30]  # the next would be 38 + 4


def test_few_shot_prompts_hold_every_example_in_their_own_order():
    node = {"name": "multi_turn", "variant": "few_shot", "num_conversations": 4, "turns": 3}
    node.update(system_prompt_len=6, num_examples=3, example_len=5, message_len=2)
    requests = make_workload(node, VOCAB)
    assert len(requests) == 12
    examples = {}
    for r in requests:
        ids = r.prompt_token_ids
        assert len(ids) == 6 + 15 + 2
        for slot, example in enumerate(r.meta["order"]):
            shot = ids[6 + 5 * slot : 11 + 5 * slot]
            assert examples.setdefault(example, shot) == shot  # the same example everywhere
    assert len({tuple(r.meta["order"]) for r in requests}) > 1  # orders vary


def test_a_bad_multi_turn_variant_is_a_config_error():
    with pytest.raises(
        ConfigError, match="unknown variant 'tree'; accepted: conversation, few_shot"
    ):
        make_workload({"name": "multi_turn", "variant": "tree"}, VOCAB)


def test_trace_lines_carry_their_client(tmp_path):
    path = tmp_path / "trace.jsonl"
    lines = [{"prompt_len": 3, "output_len": 2, "client": "a"}, {"prompt_len": 3, "output_len": 2}]
    path.write_text("\n".join(json.dumps(x) for x in lines))
    requests = make_workload({"name": "trace", "path": str(path)}, VOCAB)
    assert [r.client for r in requests] == ["a", None]
    path.write_text(json.dumps({"prompt_len": 3, "output_len": 2, "client": 7}))
    with pytest.raises(
        ConfigError, match="trace.jsonl:1: client must be a non-empty string or null"
    ):
        make_workload({"name": "trace", "path": str(path)}, VOCAB)


def test_a_served_request_records_its_client():
    llm = LLM(model="tiny", dtype="float64", max_model_len=64, kv_cache_memory=256 * 1024)
    requests = make_workload({"name": "multi_client", "clients": clients(rate=4.0)}, 100, 64)
    requests = [r for r in requests if r.arrival_time < 0.2 or r.client == "light"][:6]
    for r in requests:
        r.arrival_time = 0.0
    serve(llm.engine, requests)
    got = {r.request_id: r.client for r in llm.engine.metrics.requests}
    assert got == {r.request_id: r.client for r in requests}
    llm.engine.add_request([5, 6], SamplingParams(max_tokens=1), request_id="anon")
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert llm.engine.metrics.requests[-1].client is None
