"""`vtc`: the least-served backlogged client is admitted first, counters count
weighted prompt and output tokens, and a client back from idle is lifted."""

from __future__ import annotations

import pytest

from servelab.errors import ConfigError

from .scheduler_runs import admission_order, engine, greedy, step_until

PROMPT = [5, 6, 7, 8]  # 4 tokens; each request asks for 2 output tokens


def add(eng, request_id, client, at):
    eng.add_request(PROMPT, greedy(2), request_id=request_id, arrival_time=at, client=client)


def three_a_two_b(scheduler):
    eng = engine(scheduler)
    for i, (rid, client) in enumerate(
        [("a1", "A"), ("a2", "A"), ("a3", "A"), ("b1", "B"), ("b2", "B")]
    ):
        add(eng, rid, client, float(i))
    outputs = step_until(eng)
    return eng, outputs


def test_admission_alternates_to_the_least_served_client():
    # one slot; a request costs 4 prompt + 2 x 2 output = 8 weighted tokens. a1
    # (tie at 0, earlier) -> A=8; b1 (B=0) -> B=8; tie, a2 earlier -> A=16; b2 (8 < 16); a3
    eng, outputs = three_a_two_b({"name": "vtc"})
    assert admission_order(eng) == ["a1", "b1", "a2", "b2", "a3"]
    assert eng.scheduler.policy.counters == {"A": 24.0, "B": 16.0}
    assert eng.scheduler.policy.served == {"A": 24.0, "B": 16.0}
    fcfs, fcfs_outputs = three_a_two_b({"name": "continuous"})
    assert admission_order(fcfs) == ["a1", "a2", "a3", "b1", "b2"]
    assert {k: v.token_ids for k, v in outputs.items()} == {
        k: v.token_ids for k, v in fcfs_outputs.items()
    }


def test_weights_change_the_counts():
    eng = engine({"name": "vtc", "w_prompt": 0.5, "w_output": 3.0})
    add(eng, "a1", "A", 0.0)
    step_until(eng)
    assert eng.scheduler.policy.counters == {"A": 0.5 * 4 + 3.0 * 2}


def test_a_client_back_from_idle_is_lifted_to_the_least_backlogged_counter():
    eng = engine({"name": "vtc"})
    for i in range(3):
        add(eng, f"a{i}", "A", float(i))
    step_until(eng, lambda e: e.scheduler.policy.counters["A"] >= 16)  # a0, a1 done; a2 waits
    assert [g.request_id for g in eng.scheduler.waiting] == ["a2"]
    add(eng, "c1", "C", 9.0)
    assert eng.scheduler.policy.counters["C"] == 16.0  # not 0: idle time earns no credit
    step_until(eng)
    # with nobody backlogged, a newcomer is lifted to the last client that left the backlog
    last = eng.scheduler.policy.last_left
    add(eng, "d1", "D", 20.0)
    assert eng.scheduler.policy.counters["D"] == last > 0


@pytest.mark.parametrize(
    ("options", "problem"),
    [
        ({"w_prompt": -1.0}, "w_prompt must be a finite number >= 0"),
        ({"w_prompt": 0.0, "w_output": 0.0}, "cannot both be 0"),
    ],
)
def test_bad_weights_are_config_errors(options, problem):
    with pytest.raises(ConfigError, match=problem):
        engine({"name": "vtc", **options})
