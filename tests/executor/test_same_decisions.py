"""Simulated and real engines decide the same, step for step, for every
scheduler x allocator x preemption variant the oracle enumerates.

All requests arrive at once, each with `ignore_eos` and a fixed `max_tokens`,
one sample each: the executors' tokens differ (stand-ins vs the model's), so
nothing compared may depend on a token value (greedy forks of the real model
share their tokens and stand-in forks do not, so n > 1 under a prefix cache is
left out). The clock and the attention backend's own counters (padding, key
slots) are not decisions and are not compared; see servelab.testing.decisions.
"""

from __future__ import annotations

import pytest

from servelab.plugins.executors.simulated import SimulatedExecutor
from servelab.testing import check_executor, oracle
from servelab.testing.decisions import (
    COUNTED,
    assert_same_decisions,
    step_rows,
    workload,
)

COMBOS = oracle.combinations(("scheduler", "allocator", "preemption"))


@pytest.mark.parametrize("combo", COMBOS, ids=[oracle.combo_id(c) for c in COMBOS])
def test_simulated_makes_the_real_engines_decisions(combo):
    engine = oracle.engine_options(combo)
    budget = {"max_num_batched_tokens": engine["max_num_batched_tokens"]}
    assert assert_same_decisions(combo, "simulated", **budget) > 0


def test_the_comparison_sees_preemptions_swaps_and_prefix_hits():
    """The workload is tight enough that the compared fields are not all zero."""
    seen = dict.fromkeys(["preemptions_recompute", "preemptions_swap", "prefix_hit_tokens"], 0)
    for preemption, allocator in [("recompute", "paged"), ("swap", "paged")]:
        combo = {
            "scheduler": {"name": "continuous", "admission": "on_demand"},
            "allocator": {"name": allocator, "block_size": 4, "prefix_caching": True},
            "preemption": preemption,
        }
        for row in step_rows(combo, "simulated", workload()):
            for key in seen:
                seen[key] += row[key]
    assert all(seen.values()), seen
    assert {"kv_tokens_used", "num_seqs", "prefill_tokens", "swapped_out_bytes"} <= set(COUNTED)


class HalfBudget(SimulatedExecutor):
    """A wrong executor: it sizes the KV cache at half the budget."""

    def kv_cache_bytes(self, max_num_batched_tokens: int) -> int:
        return super().kv_cache_bytes(max_num_batched_tokens) // 2


def test_a_different_decision_fails_the_comparison():
    with pytest.raises(AssertionError, match="kv_tokens_capacity"):
        check_executor(HalfBudget)


def test_conformance_passes_the_simulated_executor():
    report = check_executor(SimulatedExecutor)
    assert len(report.combinations) == 4 and report.preempted > 0
