"""`order=lpm`, for every scheduler through the base class: the waiting request
with the longest cached prefix is admitted first; `fcfs` (the default) keeps
arrival order; the tokens are the same."""

from __future__ import annotations

import pytest

from servelab.errors import ConfigError

from .scheduler_runs import admission_order, engine, greedy, step_until

PREFIX = list(range(10, 26))  # 16 tokens: four cached blocks of 4
PAGED = {"name": "paged", "block_size": 4, "prefix_caching": True}


def run(scheduler: dict):
    eng = engine(scheduler, allocator=PAGED)
    eng.add_request(PREFIX + [3], greedy(1), request_id="warm")
    step_until(eng)  # its full blocks stay cached
    eng.add_request([40, 41, 42, 43, 44], greedy(2), request_id="cold", arrival_time=1.0)
    eng.add_request(PREFIX + [50, 51], greedy(2), request_id="shares", arrival_time=2.0)
    outputs = step_until(eng)
    return eng, {k: v.token_ids for k, v in outputs.items()}


@pytest.mark.parametrize("name", ["continuous", "chunked", "vtc", "mlfq"])
def test_lpm_admits_the_longest_cached_prefix_first(name):
    lpm, lpm_tokens = run({"name": name, "order": "lpm"})
    fcfs, fcfs_tokens = run({"name": name})
    assert admission_order(lpm) == ["warm", "shares", "cold"]
    assert admission_order(fcfs) == ["warm", "cold", "shares"]
    assert lpm_tokens == fcfs_tokens
    assert lpm.allocator.usage()["prefix_hit_tokens"] == 16


def test_an_unknown_order_lists_the_accepted_ones():
    with pytest.raises(ConfigError, match="unknown order 'sjf'.*accepted: fcfs, lpm"):
        engine({"name": "continuous", "order": "sjf"})
