"""`paged`'s prefix cache evicts in an order a plugin can replace (`EvictionOrder`,
`PagedAllocator.eviction_order`): an LFU allocator is a few lines on those public
hooks, the conformance kit runs its eviction code (and fails a planted eviction
bug), and every allocator's evictions, with a plugin's own usage figures, reach the
step records and the run summary."""

from __future__ import annotations

import pytest

from servelab import LLM, SamplingParams
from servelab.engine.summary import summarize
from servelab.errors import ConfigError
from servelab.plugins.allocators.paged import EvictionOrder, PagedAllocator
from servelab.registry.options import declared_variants
from servelab.testing.conformance import check_allocator, temporarily_registered


# -- a third-party LFU allocator, as docs/plugins.md writes it
class LFUOrder(EvictionOrder):
    """Least frequently hit first; among equals, the least recently let go."""

    def __init__(self) -> None:
        super().__init__()
        self.hits: dict[int, int] = {}

    def hit(self, block: int) -> None:
        self.hits[block] = self.hits.get(block, 0) + 1

    def evict(self) -> int:
        block = min(self.blocks, key=lambda b: self.hits.get(b, 0))  # first of the least hit
        del self.blocks[block]
        self.hits.pop(block, None)  # its next content starts from no hits
        return block


class LFUAllocator(PagedAllocator):
    description = "paged, its prefix cache evicting the least frequently hit block first"
    # what the oracle and the conformance kit run it under: a cache, so evictions happen
    oracle_variants = ({"block_size": 4, "prefix_caching": True},)

    def eviction_order(self) -> EvictionOrder:
        return LFUOrder()

    def usage(self) -> dict[str, float]:  # a figure of its own: the hits it counts
        return {**super().usage(), "lfu_tracked_blocks": len(self.free_cached.hits)}


def test_lru_evicts_the_block_let_go_longest_ago_and_lfu_the_least_hit():
    lru, lfu = EvictionOrder(), LFUOrder()
    for order in (lru, lfu):
        for block in (5, 6, 7):
            order.add(block)
    lfu.hit(5)  # block 5 was reused once: LFU keeps it, LRU does not care
    assert [lru.evict(), lru.evict()] == [5, 6]
    assert [lfu.evict(), lfu.evict()] == [6, 7]
    assert list(lru) == [7] and list(lfu) == [5] and 5 not in lru and len(lfu) == 1


class BuggyOrder(EvictionOrder):
    """A planted bug: it hands out the block to evict but keeps it evictable."""

    def evict(self) -> int:
        return next(iter(self.blocks))


class BuggyAllocator(PagedAllocator):
    oracle_variants = LFUAllocator.oracle_variants

    def eviction_order(self) -> EvictionOrder:
        return BuggyOrder()


def test_the_oracle_runs_a_part_in_the_option_sets_it_declares():
    from servelab.testing import oracle  # transformers (the reference): a dev dependency

    case = oracle.cached_case()
    with temporarily_registered("allocator", LFUAllocator) as name:
        nodes = [n for n in oracle.variants("allocator") if n["name"] == name]
        assert nodes == [{"name": name, "block_size": 4, "prefix_caching": True}]
        combo = {**oracle.combinations()[0], "allocator": nodes[0]}
        run = oracle.drive(case, combo)
        oracle.assert_matches_reference(case, combo, run)
        assert run.evictions > 0  # the declared cache evicted: LFU's own code ran
    with temporarily_registered("allocator", BuggyAllocator) as name:
        combo = {**combo, "allocator": {**nodes[0], "name": name}}
        with pytest.raises(AssertionError):  # the planted bug, through the same path
            oracle.assert_matches_reference(case, combo, oracle.drive(case, combo))


def test_a_bad_declaration_is_a_clear_error():
    class Bad(PagedAllocator):
        oracle_variants = {"prefix_caching": True}  # a dict, not a list of dicts

    with pytest.raises(ConfigError, match="oracle_variants must be a non-empty list"):
        declared_variants(Bad)
    assert declared_variants(PagedAllocator) == [{}]  # none declared: its defaults


@pytest.mark.slow
def test_the_kit_runs_lfus_evictions_and_fails_a_planted_eviction_bug():
    report = check_allocator(LFUAllocator)  # no options: the declared set
    assert report.evictions > 0  # its eviction code ran, under every combination's check
    # the shadow-KV state machine finds it (Hypothesis may group distinct failures)
    with pytest.raises(Exception) as failed:  # noqa: PT011 - the group's members are checked
        check_allocator(BuggyAllocator)
    errors = getattr(failed.value, "exceptions", (failed.value,))
    assert errors and all(isinstance(e, AssertionError) for e in errors)


def test_evictions_and_a_plugins_own_figures_reach_the_records():
    shared = list(range(10, 42))  # 8 blocks of 4 tokens every prompt shares
    prompts = [shared + [100 + i] * 6 for i in range(6)] + [[200 + i] * 40 for i in range(4)]
    with temporarily_registered("allocator", LFUAllocator) as name:
        llm = LLM(model="tiny", allocator={"name": name, "block_size": 4, "prefix_caching": True},
                  max_model_len=64, kv_cache_memory="96KiB")  # fmt: skip
        for prompt in prompts:  # one at a time: each finishes, its blocks stay cached
            llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4))
    steps = llm.engine.metrics.steps
    evicted = sum(s.extra["evictions"] for s in steps)
    assert evicted == llm.engine.allocator.usage()["evictions"] > 0
    assert all("kv_lfu_tracked_blocks" in s.row() for s in steps)
    summary = summarize(llm.engine.metrics.requests, steps)
    assert summary["evictions"] == evicted
    assert summary["kv_lfu_tracked_blocks"] == steps[-1].extra["kv_lfu_tracked_blocks"]
