"""A block-table allocator's side of a KV tier (`servelab.contracts.kv_tier`).

`TierLink` is what `BlockTableAllocator` holds once a tier is attached: it
continues a new sequence's prefix lookup below the device cache (`hits`, then
`load` into fresh blocks), hands the tier the blocks the cache evicts or
completes, and lends it the host pool (`PoolLender`), so swap and the tier
share one host budget. The subclass says how a block's key is found
(`_block_key`) and how loaded blocks join its cache (`_adopt_loaded`).

Why the bookkeeping of who reads what: the executor runs a step's copies
batched by kind (`BlockCopies`), not in the order they were queued, so a block
a queued copy still reads must not be written first. Device blocks a load was
queued into are never offered to the tier in the same step (their content
arrives with that load), and host blocks a queued swap-in reads are not lent.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from servelab.contracts.kv_tier import HostBlocks, KVTier, block_key
from servelab.step.plan import BlockCopies
from servelab.step.sequence import Sequence


class PoolLender(HostBlocks):
    """The allocator's host pool (`host_free`) as its tier borrows from it."""

    def __init__(self, host_free: deque[int], num_blocks: int) -> None:
        self.host_free = host_free
        self.num_blocks = num_blocks
        self.reading: set[int] = set()  # read by a queued swap-in: not lent this step

    def take(self) -> int | None:
        for _ in range(len(self.host_free)):
            block = self.host_free.popleft()
            if block not in self.reading:
                return block
            self.host_free.append(block)
        return None

    def give(self, block: int) -> None:
        self.host_free.append(block)


class TierLink:
    def __init__(self, alloc: Any, tier: KVTier) -> None:
        # alloc: the `paged.BlockTableAllocator` it serves (not imported: paged imports this)
        self.alloc = alloc
        self.tier = tier
        self.lender = PoolLender(alloc.host_free, alloc.num_host_blocks)
        tier.bind(self.lender if alloc.num_host_blocks else None)
        self.loading: set[int] = set()  # device blocks a load was queued into this step

    # -- the lookup below the device cache
    def hits(self, seq: Sequence, matched: list[int], max_blocks: int | None = None) -> list[bytes]:
        """The keys of the blocks right after the device match `matched` that the
        tier holds, in order (as many as `_matched_blocks` could reach, at most
        `max_blocks` blocks with the match)."""
        if seq.params.prompt_logprobs is not None:  # every prompt position computed
            return []
        bs, tokens = self.alloc.block_size, seq.token_ids
        last = (seq.num_tokens - 1) // bs  # leave at least one token to compute
        if max_blocks is not None:
            last = min(last, max_blocks)
        parent = self.alloc._block_key(matched[-1]) if matched else None
        keys: list[bytes] = []
        for i in range(len(matched), last):
            key = block_key(parent, tokens[i * bs : (i + 1) * bs])
            if not self.tier.holds(key):
                break
            keys.append(key)
            parent = key
        return keys

    def load(self, seq: Sequence, table: list[int], num_tokens: int) -> None:
        """Appends to `table` (a new sequence's device match) a fresh block for each
        tier hit after it, loaded from the tier, and lets the allocator's cache adopt
        them; a load the tier refuses ends the run there (the rest is computed)."""
        alloc, bs = self.alloc, self.alloc.block_size
        matched = len(table)
        keys = self.hits(seq, table, -(-num_tokens // bs))
        # every block first: taking one may evict a device block into the tier, pushing one
        # of these keys out of it; that key's load then fails and the rest is computed
        fresh = [alloc._take_free() for _ in keys]
        loaded = 0
        for i, (key, block) in enumerate(zip(keys, fresh)):
            index = matched + i
            tokens = tuple(seq.token_ids[index * bs : (index + 1) * bs])
            if not self.tier.load(key, tokens, block):
                break
            alloc._set_fill(block, bs)
            self.loading.add(block)
            table.append(block)
            loaded += 1
        for block in fresh[loaded:]:
            alloc._release(block)  # unfilled and unpublished: back to the free list
        if loaded:
            alloc._adopt_loaded(seq, table, matched, keys[:loaded])
        if seq.params.prompt_logprobs is None:
            computable = (seq.num_tokens - 1) // bs - len(table)
            if computable > 0:
                self.tier.missed(computable)

    # -- what the device cache lets go
    def evicted(self, key: bytes, tokens: tuple[int, ...], block: int) -> None:
        """The cache evicts a published block (write-back tiers keep it now)."""
        if not self.tier.write_through and block not in self.loading:
            self.tier.store(key, tokens, block)

    def completed(self, key: bytes, tokens: tuple[int, ...], block: int) -> None:
        """The cache published a block just computed (write-through tiers keep it now)."""
        if self.tier.write_through and block not in self.loading:
            self.tier.store(key, tokens, block)

    # -- the host pool, shared with swap
    def host_blocks_free(self) -> int:
        """Host blocks a swap-out could have: the pool's free ones and the tier's to give back."""
        return len(self.lender.host_free) + self.tier.reclaimable_host_blocks()

    def make_host_room(self, num_blocks: int) -> None:
        """Takes host blocks back from the tier until `num_blocks` are free."""
        short = num_blocks - len(self.lender.host_free)
        if short > 0:
            self.tier.reclaim_host_blocks(short)

    def swapping_in(self, host_blocks: list[int]) -> None:
        self.lender.reading.update(host_blocks)

    def take_copies(self, copies: BlockCopies) -> BlockCopies:
        copies.extend(self.tier.take_copies())
        self.loading.clear()
        self.lender.reading.clear()
        return copies
