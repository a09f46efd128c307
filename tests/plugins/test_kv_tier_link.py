"""The allocator's side of a KV tier, rule by rule (`servelab.plugins.allocators.tiering`):
the executor runs a step's copies batched by kind, so a block a queued copy still
reads must not be written first. A device block loaded this step is never offered
to the tier again in it (its content arrives with that load), a host block a
queued swap-in reads is not lent to the tier, and a swap-out takes host blocks
back from the tier."""

from __future__ import annotations

from servelab.contracts.kv_tier import KVTier
from servelab.plugins.allocators.paged import PagedAllocator
from servelab.plugins.kv_tiers.host import HostTier
from servelab.step.sequence import SamplingParams, Sequence


class Recording(HostTier):
    """A host tier that remembers every block it was offered."""

    def __init__(self, **kwargs):
        super().__init__(block_bytes=4, kv_identity={"block_size": 4}, payloads=False, **kwargs)
        self.offered: list[int] = []

    def store(self, key, tokens, block):
        self.offered.append(block)
        super().store(key, tokens, block)


def paged(blocks: int = 4, host_blocks: int = 8) -> tuple[PagedAllocator, KVTier]:
    alloc = PagedAllocator(4 * blocks, 4 * host_blocks, 16, block_size=4, prefix_caching=True)
    tier = Recording()
    alloc.attach_tier(tier)
    return alloc, tier


def computed(alloc: PagedAllocator, tokens: list[int]) -> Sequence:
    """A sequence whose tokens were all computed (allocated, then committed)."""
    seq = Sequence("r", tokens, SamplingParams())
    seq.num_computed_tokens = alloc.allocate(seq, len(tokens))
    seq.num_computed_tokens = len(tokens)
    alloc.commit(seq)
    return seq


def test_a_block_loaded_this_step_is_not_offered_again_when_evicted_in_it():
    alloc, tier = paged()
    first = computed(alloc, list(range(10, 22)))  # three full blocks, cached when freed
    alloc.free(first)
    other = computed(alloc, list(range(50, 66)))  # evicts all three into the tier
    alloc.free(other)
    alloc.take_copies()
    again = Sequence("r", list(range(10, 22)) + [1], SamplingParams())
    assert alloc.match_prefix(again) == 12
    assert alloc.allocate(again, again.num_tokens) == 12  # loaded from the tier
    loaded = alloc.block_table(again)[:3]
    alloc.free(again)  # given up in the same step (an admission that did not fit)
    tier.offered.clear()
    computed(alloc, list(range(70, 86)))  # takes every block: evicts the loaded ones
    assert not set(tier.offered) & set(loaded), "a block was stored before its load ran"
    copies = alloc.take_copies()
    assert {dst for _, dst in copies.tier_in} == set(loaded)
    alloc.check_integrity()
    tier.check_integrity()


def test_a_host_block_a_swap_in_reads_is_not_lent_before_the_copies_leave():
    alloc, tier = paged(blocks=4, host_blocks=2)
    seq = computed(alloc, list(range(10, 18)))  # two blocks
    alloc.swap_out([seq])
    alloc.take_copies()
    sources = list(alloc.host_tables[seq.seq_id])
    alloc.swap_in([seq])  # reads both host blocks: queued, not run yet
    assert sorted(alloc.host_free) == sorted(sources)
    assert tier.host.take() is None, "a host block a queued swap-in reads was lent"
    alloc.take_copies()  # the executor ran them
    assert tier.host.take() in sources


def test_a_swap_out_takes_host_blocks_back_from_the_tier():
    alloc, tier = paged(blocks=4, host_blocks=4)
    cached = computed(alloc, list(range(10, 22)))  # three full blocks
    alloc.free(cached)
    running = computed(alloc, list(range(50, 66)))  # four blocks: evicts those three
    alloc.take_copies()
    assert len(tier.host_blocks_held()) == 3 and len(alloc.host_free) == 1
    assert alloc.usage()["host_blocks_free"] == 4  # the tier's count: it gives them back
    assert alloc.can_swap_out([running])
    alloc.swap_out([running])
    copies = alloc.take_copies()
    assert len(copies.swap_out) == 4 and tier.host_blocks_held() == []
    assert tier.figures.blocks_evicted == 3
    alloc.check_integrity()
    tier.check_integrity()
