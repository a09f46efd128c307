"""`hybrid`: the choice rule (swap at break_even_tokens and above, recompute
below, recompute when the host pool is full), alone and in an engine."""

from __future__ import annotations

import pytest

from servelab.errors import ConfigError
from servelab.plugins.allocators.paged import PagedAllocator
from servelab.plugins.preemption.hybrid import HybridPolicy
from servelab.step.sequence import SamplingParams, Sequence

from .scheduler_runs import engine, greedy, step_until


def computed(tokens: int) -> Sequence:
    seq = Sequence("r", list(range(2, 2 + tokens)), SamplingParams())
    seq.num_computed_tokens = tokens
    return seq


def allocator(host_tokens: int) -> PagedAllocator:
    return PagedAllocator(
        token_capacity=64, host_token_capacity=host_tokens, max_model_len=32, block_size=4
    )


@pytest.mark.parametrize(
    ("lengths", "kind"),
    [
        ([7], "waiting"),
        ([8], "swapped"),
        ([12], "swapped"),
        ([4, 4], "swapped"),
        ([3, 4], "waiting"),
    ],
)
def test_victims_at_or_above_break_even_are_swapped_and_shorter_ones_recomputed(lengths, kind):
    alloc = allocator(host_tokens=64)
    group = [computed(n) for n in lengths]
    for seq in group:
        alloc.allocate(seq, seq.num_tokens)
    assert HybridPolicy(break_even_tokens=8).preempt(group, alloc) == kind
    held = alloc.num_blocks - alloc.num_free_blocks
    assert held == 0  # either way the device blocks are free
    assert (len(alloc.host_tables) > 0) == (kind == "swapped")


def test_a_long_victim_is_recomputed_when_the_host_pool_is_full():
    alloc = allocator(host_tokens=8)  # two host blocks; the victim holds three
    seq = computed(12)
    alloc.allocate(seq, 12)
    assert HybridPolicy(break_even_tokens=8).preempt([seq], alloc) == "waiting"


def test_in_an_engine_long_victims_swap_and_short_ones_recompute():
    counts = {}
    for break_even in (0, 10**6):
        eng = engine(
            {"name": "continuous"},
            preemption={"name": "hybrid", "break_even_tokens": break_even},
            max_num_seqs=4,
            allocator={"name": "paged", "block_size": 4},
            max_model_len=32,
            kv_cache_memory=24 * 1024,  # 48 tokens of the float32 tiny model
            swap_space=64 * 1024,
        )
        for i, length in enumerate([20, 4, 4, 4]):
            eng.add_request(list(range(3 + i, 3 + i + length)), greedy(10), request_id=f"r{i}")
        step_until(eng)
        counts[break_even] = dict(eng.scheduler.num_preemptions)
    assert counts[0]["recompute"] == 0 and counts[0]["swap"] > 0  # everything swaps
    assert counts[10**6]["swap"] == 0 and counts[10**6]["recompute"] > 0  # nothing does


def test_a_negative_break_even_is_a_config_error():
    with pytest.raises(ConfigError, match="break_even_tokens must be an integer >= 0"):
        HybridPolicy(break_even_tokens=-1)
