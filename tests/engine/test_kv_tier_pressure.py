"""KV tiers under memory pressure: random requests (shared prefixes, n > 1,
seeded sampling, priorities, aborts) through a device cache of a few blocks,
twice over (a later turn finds its prefixes evicted), with every built-in tier
on the paged (hashed prefix caching) and radix allocators under recompute,
swap and hybrid preemption. Every request's tokens equal the same request run
alone with ample memory and no tier; after every step the allocator, the
scheduler and the tier keep their invariants and host memory is one budget
(swapped blocks + the tier's + free = the pool); at the end no block is held.
"""

from __future__ import annotations

import tempfile

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings

from servelab.testing.oracle import restored_num_threads
from tests.engine.test_memory import KIB, MAX_MODEL_LEN, alone, requests, run_checked, tiny

ALLOCATORS = [
    {"name": "paged", "block_size": 4, "prefix_caching": True},
    {"name": "radix", "page_size": 2},
    {"name": "radix", "page_size": 1},
]
TIERS = [
    {"name": "host"},
    {"name": "host", "policy": "write_through", "capacity_blocks": 24},
    {"name": "disk"},
    {"name": "tiered", "host_capacity_blocks": 8},
]


def check_host_budget(eng) -> None:
    alloc, tier = eng.allocator, eng.kv_tier
    swapped = {b for table in alloc.host_tables.values() for b in table}
    held = tier.host_blocks_held()
    assert len(swapped) + len(held) + len(alloc.host_free) == alloc.num_host_blocks, (
        "host memory exceeds its one budget for swap and the tier"
    )


def check_tier(eng) -> None:
    eng.kv_tier.check_integrity()
    check_host_budget(eng)


def run_round(llm, reqs, abort_at: dict[int, int], prefix: str) -> tuple[dict, set]:
    """Every request of `reqs` to the end, the invariants (the tier's and the host
    budget too) checked after every step."""
    rejected: dict[str, str] = {}
    finished, aborted, _ = run_checked(llm, reqs, abort_at, rejected, prefix, check_tier)
    return finished, aborted | set(rejected)


@pytest.mark.parametrize(
    "preemption", ["recompute", "swap", {"name": "hybrid", "break_even_tokens": 12}]
)
def test_tiers_change_no_token_under_pressure(preemption):
    loaded: list[int] = []

    @settings(
        max_examples=12, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True
    )
    @given(
        reqs=requests(),
        scheduler=st.sampled_from(["continuous", "chunked"]),
        allocator=st.sampled_from(ALLOCATORS),
        tier=st.sampled_from(TIERS),
        budget=st.integers(MAX_MODEL_LEN, 80),
        abort=st.dictionaries(st.integers(0, 6), st.integers(0, 12), max_size=1),
    )
    def check(reqs, scheduler, allocator, tier, budget, abort):
        sched = {"name": scheduler, "admission": "on_demand"}
        if scheduler == "chunked":
            sched["chunk_size"] = 8
        with tempfile.TemporaryDirectory() as folder:
            node = {**tier, "path": folder} if tier["name"] in ("disk", "tiered") else tier
            llm = tiny(
                scheduler=sched,
                allocator=allocator,
                preemption=preemption,
                kv_tier=node,
                kv_cache_memory=budget * KIB,
                max_num_batched_tokens=24 if scheduler == "chunked" else MAX_MODEL_LEN,
                num_threads=1,  # a tiny model: one thread is fastest, on a busy machine too
            )
            abort = {i: s for i, s in abort.items() if i < len(reqs)}
            for turn in range(2):  # the second turn repeats every prompt, after the first
                finished, skipped = run_round(llm, reqs, abort if turn == 0 else {}, f"t{turn}-")
                for i, (prompt, params, _) in enumerate(reqs):
                    out = finished.get(f"t{turn}-{i}")
                    if (
                        f"t{turn}-{i}" in skipped
                        or out is None
                        or out.finish_reason == "cache_full"
                    ):
                        continue
                    want = alone(tuple(prompt), params)
                    assert [c.token_ids for c in out.outputs] == want, (turn, i, node)
            usage = llm.engine.allocator.usage()
            assert usage["blocks_free"] == usage["blocks_total"], "device blocks leaked"
            assert usage["host_blocks_free"] == usage["host_blocks_total"], "host blocks leaked"
            loaded.append(llm.engine.kv_tier.figures.hits)

    with restored_num_threads():  # the engines set torch's process-wide thread count
        check()
    assert sum(1 for hits in loaded if hits) >= len(loaded) // 2, loaded
