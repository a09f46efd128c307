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


@pytest.mark.parametrize("page_size", [1, 2])
def test_two_prompts_prefilled_together_share_their_prefix_and_both_are_cached(page_size):
    """Neither prompt found the other in the tree when both were admitted (one
    step prefills both). The second to commit swaps its copies of the shared
    pages for the first's blocks (its own freed), and its own pages hang under
    them, so a later request continuing either one hits all of it."""
    alloc = make(page_size=page_size)
    shared = [1, 2, 3, 4]
    a = Sequence("a", shared + [5, 6], SamplingParams())
    b = Sequence("b", shared + [7, 8, 9, 10], SamplingParams())
    for seq in (a, b):
        assert alloc.allocate(seq, seq.num_tokens) == 0  # nothing cached yet
    used = alloc.num_free_blocks
    for seq in (a, b):
        seq.num_computed_tokens = seq.num_tokens
    assert alloc.commit(a) is False  # first: its table is its own
    b_before = list(alloc.block_table(b))
    assert alloc.commit(b) is True  # second: its table now reads a's shared blocks
    alloc.check_integrity()
    pages = len(shared) // page_size
    table_a, table_b = alloc.block_table(a), alloc.block_table(b)
    assert table_b[:pages] == table_a[:pages] and table_b[pages:] == b_before[pages:]
    assert all(alloc.ref_count[block] == 2 for block in table_a[:pages])
    assert alloc.num_free_blocks == used + pages  # b's copies of the shared pages were freed
    assert hit(alloc, b.token_ids + [99]) == b.num_tokens  # b's own pages are cached too
    assert hit(alloc, a.token_ids + [99]) == a.num_tokens
    for seq in (a, b):
        alloc.free(seq)
        alloc.check_integrity()
    assert hit(alloc, b.token_ids + [99]) == b.num_tokens  # and stay cached after both end


def test_identical_prompts_share_blocks_while_they_decode_and_keep_their_tokens(monkeypatch):
    """Through the engine: three copies of one prompt, prefilled in one step,
    decode the same tokens; each page the later copies fill is one the first
    cached a moment before, so their tables are rewritten inside the decode
    fast path (which then rebuilds its arrays). Every copy still gives
    transformers' tokens, and the allocator's invariants hold after every step."""
    import dataclasses

    from servelab.testing.oracle import assert_matches_reference, cached_case, drive

    rewrites = []
    commit_decodes = RadixAllocator.commit_decodes

    def counted(self, *args):
        rewrites.append(commit_decodes(self, *args))
        return rewrites[-1]

    monkeypatch.setattr(RadixAllocator, "commit_decodes", counted)
    case = cached_case("qwen3")
    longest = max(range(len(case.prompts)), key=lambda i: case.params[i].max_tokens)
    copies = dataclasses.replace(
        case,
        prompts=[case.prompts[longest]] * 3,
        params=[case.params[longest]] * 3,
        expected=[case.expected[longest]] * 3,
    )
    combo = {
        "scheduler": {"name": "continuous", "admission": "on_demand"},
        "allocator": {"name": "radix", "page_size": 1},
        "preemption": {"name": "recompute"},
        "attention": {"name": "per_request"},
    }
    run = drive(copies, combo, kv_cache_memory="4MiB")
    assert_matches_reference(copies, combo, run)
    assert run.preempted == 0  # room for all three: the decodes ran side by side
    assert any(rewrites), "no table was rewritten during a fast decode step"
