"""A KV tier's figures in the run's records: each step's `tier_*` increases
(steps.csv's columns), their sums in the run summary (results.json), and none
of them without a tier."""

from __future__ import annotations

import pytest

from servelab.engine.summary import TIER_COUNTS, summarize
from tests.engine.test_kv_tiers import run_rounds

COMBO = {
    "scheduler": {"name": "continuous"},
    "allocator": {"name": "paged", "block_size": 4, "prefix_caching": True},
    "preemption": {"name": "recompute"},
    "attention": {"name": "per_request"},
}


def test_step_records_and_the_summary_count_the_tiers_work():
    _, llm = run_rounds({**COMBO, "kv_tier": {"name": "host"}})
    metrics, tier = llm.engine.metrics, llm.engine.kv_tier
    rows = [step.row() for step in metrics.steps]
    assert all(set(TIER_COUNTS) | {"tier_host_blocks"} <= set(row) for row in rows)
    summary = summarize(metrics.requests, metrics.steps)
    figures = tier.figures
    assert summary["tier_hits"] == sum(r["tier_hits"] for r in rows) == figures.hits > 0
    assert summary["tier_hit_tokens"] == figures.hit_tokens
    assert summary["tier_bytes_stored"] == figures.blocks_stored * tier.block_bytes
    assert summary["tier_bytes_loaded"] == figures.hits * tier.block_bytes
    assert summary["tier_hit_rate"] == figures.hits / (figures.hits + figures.misses)
    assert summary["tier_host_blocks"] == len(tier.entries)
    assert summary["tier_load_ms"] == pytest.approx(sum(r["tier_load_ms"] for r in rows))


def test_no_tier_no_tier_figures():
    _, llm = run_rounds({**COMBO, "kv_tier": {"name": "none"}}, rounds=1)
    metrics = llm.engine.metrics
    assert not any(k.startswith("tier_") for k in metrics.steps[-1].row())
    assert not any(k.startswith("tier_") for k in summarize(metrics.requests, metrics.steps))
