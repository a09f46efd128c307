"""`radix` alone: matches end at any page boundary (inside an edge too, which
splits it), output tokens are cached for the next turn, least-recently-used
leaves are evicted first, and a held prefix is never evicted."""

from __future__ import annotations

import pytest

from servelab.errors import ConfigError
from servelab.plugins.allocators.radix import RadixAllocator
from servelab.step.sequence import SamplingParams, Sequence


def make(tokens: int = 64, page_size: int = 1) -> RadixAllocator:
    return RadixAllocator(
        token_capacity=tokens, host_token_capacity=tokens, max_model_len=32, page_size=page_size
    )


def run(alloc: RadixAllocator, tokens: list[int], free: bool = True) -> Sequence:
    """Admits a sequence, computes all its tokens, optionally frees it."""
    seq = Sequence("r", tokens, SamplingParams())
    cached = alloc.allocate(seq, seq.num_tokens)
    seq.num_cached_tokens = cached
    seq.num_computed_tokens = seq.num_tokens
    alloc.commit(seq)
    alloc.check_integrity()
    if free:
        alloc.free(seq)
        alloc.check_integrity()
    return seq


def hit(alloc: RadixAllocator, tokens: list[int]) -> int:
    return alloc.match_prefix(Sequence("q", tokens, SamplingParams()))


def test_a_match_ends_at_any_token_and_splits_the_edge():
    alloc = make()
    run(alloc, [1, 2, 3, 4, 5, 6, 7])
    assert hit(alloc, [1, 2, 3, 9, 9]) == 3  # inside the cached run of 7
    seq = run(alloc, [1, 2, 3, 9, 9], free=False)
    assert seq.num_cached_tokens == 3
    runs = sorted(node.key for node in alloc.tree.nodes())
    assert runs == [(1, 2, 3), (4, 5, 6, 7), (9, 9)]  # the edge was cut after token 3
    assert hit(alloc, [1, 2, 3, 4, 5, 6, 7, 8]) == 7
    assert hit(alloc, [1, 2, 3, 4, 5, 6, 7]) == 6  # always one token left to compute


def test_pages_match_to_the_last_page_boundary():
    alloc = make(page_size=4)
    run(alloc, list(range(10, 22)))  # 12 tokens: three full pages
    assert hit(alloc, list(range(10, 19)) + [99]) == 8  # 9 equal tokens -> 2 whole pages


def test_output_tokens_are_cached_for_the_next_turn():
    alloc = make()
    seq = Sequence("turn-1", [5, 6, 7], SamplingParams())
    alloc.allocate(seq, 3)
    seq.num_computed_tokens = 3
    alloc.commit(seq)
    for token in (8, 9):  # two decode steps: the sampled token's K/V is written next step
        seq.append_token(token)
        alloc.allocate(seq, seq.num_tokens)
        seq.num_computed_tokens = seq.num_tokens
        alloc.commit(seq)
    alloc.free(seq)
    assert hit(alloc, [5, 6, 7, 8, 9, 42, 43]) == 5  # prompt and reply, resent with a new message
    assert len(list(alloc.tree.nodes())) == 1  # one run, grown in place


def test_least_recently_used_leaves_are_evicted_first_and_held_ones_never():
    alloc = make(tokens=32)
    run(alloc, [1] * 10)  # oldest
    run(alloc, [2] * 10)
    held = run(alloc, [3] * 10, free=False)
    run(alloc, [2] * 10 + [5])  # touches the [2] run again
    assert alloc.num_free_blocks == 32 - 10
    run(alloc, [4] * 11)  # needs 11 blocks: 1 free + evicts [1]*10, the least recently used
    assert hit(alloc, [1] * 10) == 0
    assert hit(alloc, [2] * 10) == 9 and hit(alloc, [3] * 10) == 9
    run(alloc, [6] * 20)  # evicts more, never the held run
    assert alloc.block_table(held) and hit(alloc, [3] * 10) == 9
    alloc.free(held)
    alloc.check_integrity()
    assert alloc.num_free_blocks == 32


def test_page_size_must_be_a_positive_integer():
    with pytest.raises(ConfigError, match="page_size must be an integer >= 1"):
        make(page_size=0)
