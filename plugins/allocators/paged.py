"""`paged`: fixed-size KV blocks from a free list, allocated on demand (vLLM's
PagedAttention), with optional prefix caching and copy-on-write forks.

`BlockTableAllocator` is the block-table machinery `paged` and `radix` share:
fixed-size device blocks with ref counts and fill counts, per-sequence block
tables, fork with copy-on-write of a shared tail block, a host pool for
swapping, and the usage figures. A subclass brings the prefix cache: how
blocks are matched, attached, published, kept cached once unreferenced, and
evicted.

`paged`'s prefix caching: a full, computed block is published under a chain
hash `hash((parent_hash, tokens))`; a later sequence whose leading tokens hash
the same reuses the physical block (ref count +1) after a token comparison
guards against collisions. A freed block that holds a hash stays reusable in
an LRU list and is evicted only when a plain free block is needed.
"""

from __future__ import annotations

import abc
from collections import OrderedDict, deque

from servelab.contracts.allocator import KVAllocator
from servelab.contracts.hookspecs import hookimpl
from servelab.contracts.kv_tier import KVTier, block_key
from servelab.errors import ConfigError
from servelab.plugins.allocators.tiering import TierLink
from servelab.step.plan import BlockCopies
from servelab.step.sequence import Sequence


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockTableAllocator(KVAllocator):
    """Block tables over `token_capacity // block_size` device blocks; see the module doc."""

    prefix_caching = False

    def __init__(
        self, token_capacity: int, host_token_capacity: int, max_model_len: int, block_size: int
    ) -> None:
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.num_blocks = token_capacity // block_size
        if self.num_blocks * block_size < max_model_len:
            raise ConfigError(
                f"KV cache too small: its memory (kv_cache_memory, or what gpu_memory_utilization "
                f"leaves) holds {token_capacity} tokens ({self.num_blocks} blocks of {block_size}), "
                f"less than one sequence of max_model_len={max_model_len} tokens; raise that "
                "memory or lower max_model_len"
            )
        self.num_host_blocks = host_token_capacity // block_size
        self.ref_count = [0] * self.num_blocks  # block tables holding each block
        self.fill = [0] * self.num_blocks  # tokens whose K/V the block holds
        self.free_list: deque[int] = deque(range(self.num_blocks))  # neither held nor cached
        self.tables: dict[int, list[int]] = {}
        self.filled_upto: dict[int, int] = {}  # tokens of the sequence reflected in `fill`
        self.tokens_used = 0  # sum of fill over referenced blocks
        self.host_ref_count = [0] * self.num_host_blocks
        self.host_free: deque[int] = deque(range(self.num_host_blocks))
        self.host_tables: dict[int, list[int]] = {}
        self.host_fill: dict[int, int] = {}  # host block -> fill
        self.copies = BlockCopies()
        self.prefix_hit_tokens = self.prefix_query_tokens = 0
        self.blocks_swapped_out = self.blocks_swapped_in = self.blocks_copied = 0
        self.evictions = 0  # cached blocks evicted so far (a subclass's cache counts them)
        self.tier_link: TierLink | None = None  # a KV tier below the cache (`attach_tier`)

    # -- what a prefix cache provides
    @abc.abstractmethod
    def _take_free(self) -> int:
        """A block with ref count 1, from the free list or by evicting a cached one."""

    @abc.abstractmethod
    def _matched_blocks(self, seq: Sequence) -> list[int]:
        """The cached blocks a new sequence's prompt would reuse (nothing is taken)."""

    @abc.abstractmethod
    def _attach(self, seq: Sequence) -> list[int]:
        """A new sequence's first blocks: its matched prefix, each held (`_revive`)."""

    def _publish(self, seq: Sequence, table: list[int]) -> bool:
        """Offers the sequence's computed blocks to the prefix cache; True when
        it rewrote `table` (see `KVAllocator.commit`)."""
        return False

    def _uncache(self, block: int) -> None:
        """A cached block no table held is held again: it is no longer evictable."""

    def _keep_cached(self, block: int) -> bool:
        """Keeps a block no table holds any more as cache; says whether it did."""
        return False

    def _pinned(self, block: int) -> bool:
        """A block others may read through the cache: a write into it copies it first."""
        return False

    # -- what a KV tier below the cache needs (`tiering.TierLink`)
    def attach_tier(self, tier: KVTier) -> None:
        self.tier_link = TierLink(self, tier)

    def _block_key(self, block: int) -> bytes:
        """The tier key (`block_key`) of a cached block."""
        raise NotImplementedError

    def _adopt_loaded(self, seq: Sequence, table: list[int], start: int, keys: list[bytes]) -> None:
        """`table[start:]` were just loaded from the tier under `keys`: cache them."""

    # -- block primitives
    def _revive(self, block: int) -> None:
        """One more table holds a block found in the prefix cache."""
        if self.ref_count[block] == 0:
            self._uncache(block)
            self.tokens_used += self.fill[block]
        self.ref_count[block] += 1

    def _release(self, block: int) -> None:
        self.ref_count[block] -= 1
        if self.ref_count[block] == 0:
            self.tokens_used -= self.fill[block]
            if not self._keep_cached(block):
                self.fill[block] = 0
                self.free_list.append(block)

    def _set_fill(self, block: int, tokens: int) -> None:
        if tokens > self.fill[block]:
            self.tokens_used += tokens - self.fill[block]
            self.fill[block] = tokens

    # -- prefix matching and commits
    def match_prefix(self, seq: Sequence) -> int:
        matched = self._matched_blocks(seq)
        below = len(self.tier_link.hits(seq, matched)) if self.tier_link is not None else 0
        return (len(matched) + below) * self.block_size

    def commit(self, seq: Sequence) -> bool:
        table = self.tables.get(seq.seq_id)
        if table is None:
            return False
        bs, computed = self.block_size, seq.num_computed_tokens
        for i in range(self.filled_upto.get(seq.seq_id, 0) // bs, cdiv(computed, bs)):
            self._set_fill(table[i], min(bs, computed - i * bs))
        self.filled_upto[seq.seq_id] = computed
        return self._publish(seq, table)

    # -- allocation
    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        table = self.tables.get(seq.seq_id)
        if table is None:
            matched = self._matched_blocks(seq)
            reclaimed = sum(1 for b in matched if self.ref_count[b] == 0)
            return max(0, cdiv(num_tokens, self.block_size) - len(matched)) + reclaimed
        return max(0, cdiv(num_tokens, self.block_size) - len(table)) + self._cow_needed(seq, table)

    def blocks_needed_together(self, requests: list[tuple[Sequence, int]]) -> int:
        # the last of k writers into a block only they share keeps it, unless it is pinned
        need, writers = 0, {}
        for seq, num_tokens in requests:
            table = self.tables.get(seq.seq_id)
            if table is None:
                need += self.blocks_needed(seq, num_tokens)
                continue
            need += max(0, cdiv(num_tokens, self.block_size) - len(table))
            if self._cow_needed(seq, table):
                block = table[seq.num_computed_tokens // self.block_size]
                writers[block] = writers.get(block, 0) + 1
        for block, count in writers.items():
            keeps = self.ref_count[block] == count and not self._pinned(block)
            need += count - 1 if keeps else count
        return need

    def _cow_needed(self, seq: Sequence, table: list[int]) -> int:
        index = seq.num_computed_tokens // self.block_size
        if index >= len(table):
            return 0
        block = table[index]
        return int(self.ref_count[block] > 1 or self._pinned(block))

    def allocate(self, seq: Sequence, num_tokens: int) -> int:
        if self.blocks_needed(seq, num_tokens) > self.num_free_blocks:
            raise RuntimeError(
                f"allocate({seq}, {num_tokens}) without room; check blocks_needed first"
            )
        cached = 0
        table = self.tables.get(seq.seq_id)
        if table is None:
            table = self.tables[seq.seq_id] = self._attach(seq)
            if self.tier_link is not None:  # the lookup goes on below the device cache
                self.tier_link.load(seq, table, num_tokens)
            cached = len(table) * self.block_size
            self.filled_upto[seq.seq_id] = cached
            if self.prefix_caching:
                self.prefix_hit_tokens += cached
                self.prefix_query_tokens += seq.num_tokens
        elif self._cow_needed(seq, table):
            self._copy_on_write(seq, table)
        while len(table) < cdiv(num_tokens, self.block_size):
            table.append(self._take_free())
        return cached

    def _copy_on_write(self, seq: Sequence, table: list[int]) -> int:
        """Replaces the block the sequence writes next by a private copy; returns its index."""
        index = seq.num_computed_tokens // self.block_size
        src, dst = table[index], self._take_free()
        self.copies.copy.append((src, dst))
        self.blocks_copied += 1
        self._set_fill(dst, self.fill[src])
        self._release(src)  # another table still holds it, or the cache keeps it
        table[index] = dst
        return index

    def free(self, seq: Sequence) -> None:
        table = self.tables.pop(seq.seq_id, None)
        if table is not None:
            for block in reversed(table):  # tail blocks become the first evicted
                self._release(block)
        self.filled_upto.pop(seq.seq_id, None)
        for block in self.host_tables.pop(seq.seq_id, []):
            self._release_host(block)

    def block_table(self, seq: Sequence) -> list[int]:
        return self.tables[seq.seq_id]

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        # the blocks past num_tokens were taken this step for drafts: private, unfilled
        table = self.tables.get(seq.seq_id)
        if table is not None:
            keep = cdiv(num_tokens, self.block_size)
            while len(table) > keep:
                self._release(table.pop())

    def fork(self, parent: Sequence, child: Sequence) -> None:
        table = self.tables[parent.seq_id]
        for block in table:
            self.ref_count[block] += 1
        self.tables[child.seq_id] = list(table)
        self.filled_upto[child.seq_id] = self.filled_upto.get(parent.seq_id, 0)

    # -- swapping
    def _release_host(self, block: int) -> None:
        self.host_ref_count[block] -= 1
        if self.host_ref_count[block] == 0:
            self.host_fill.pop(block, None)
            self.host_free.append(block)

    def can_swap_out(self, seqs: list[Sequence]) -> bool:
        blocks = {b for s in seqs for b in self.tables[s.seq_id]}
        if self.tier_link is not None:  # the tier gives its host blocks back to swap
            return len(blocks) <= self.tier_link.host_blocks_free()
        return len(blocks) <= len(self.host_free)

    def _swapped_out(self, seq: Sequence) -> None:
        """The sequence's device blocks went to the host pool."""

    def _swapped_in(self, seq: Sequence) -> None:
        """The sequence came back in fresh device blocks (shared where its host ones were)."""

    def swap_out(self, seqs: list[Sequence]) -> None:
        if self.tier_link is not None:
            self.tier_link.make_host_room(len({b for s in seqs for b in self.tables[s.seq_id]}))
        to_host: dict[int, int] = {}
        for seq in seqs:
            host_table = []
            for block in self.tables[seq.seq_id]:
                if block not in to_host:  # a block forks share moves once
                    to_host[block] = host = self.host_free.popleft()
                    self.host_fill[host] = self.fill[block]
                    self.copies.swap_out.append((block, host))
                self.host_ref_count[to_host[block]] += 1
                host_table.append(to_host[block])
            for block in reversed(self.tables.pop(seq.seq_id)):
                self._release(block)  # a cached block stays cached
            self.host_tables[seq.seq_id] = host_table
            self._swapped_out(seq)
        self.blocks_swapped_out += len(to_host)

    def can_swap_in(self, seqs: list[Sequence]) -> bool:
        blocks = {b for s in seqs for b in self.host_tables[s.seq_id]}
        return len(blocks) <= self.num_free_blocks

    def swap_in(self, seqs: list[Sequence]) -> None:
        to_device: dict[int, int] = {}
        if self.tier_link is not None:  # their host blocks are read by this step's copies
            self.tier_link.swapping_in([h for s in seqs for h in self.host_tables[s.seq_id]])
        for seq in seqs:
            table = []
            for host in self.host_tables.pop(seq.seq_id):
                if host not in to_device:
                    to_device[host] = block = self._take_free()
                    self._set_fill(block, self.host_fill[host])
                    self.copies.swap_in.append((host, block))
                else:
                    self.ref_count[to_device[host]] += 1
                table.append(to_device[host])
                self._release_host(host)
            self.tables[seq.seq_id] = table
            self._swapped_in(seq)
        self.blocks_swapped_in += len(to_device)

    def take_copies(self) -> BlockCopies:
        copies, self.copies = self.copies, BlockCopies()
        if self.tier_link is not None:
            return self.tier_link.take_copies(copies)
        return copies

    # -- figures
    def usage(self) -> dict[str, float]:
        return {
            "tokens_used": self.tokens_used,
            "tokens_reserved": (self.num_blocks - self.num_free_blocks) * self.block_size,
            "tokens_capacity": self.num_blocks * self.block_size,
            "blocks_free": self.num_free_blocks,
            "blocks_total": self.num_blocks,
            "host_blocks_free": len(self.host_free)
            if self.tier_link is None
            else self.tier_link.host_blocks_free(),
            "host_blocks_total": self.num_host_blocks,
            "prefix_hit_tokens": self.prefix_hit_tokens,
            "prefix_query_tokens": self.prefix_query_tokens,
            "blocks_swapped_out": self.blocks_swapped_out,
            "blocks_swapped_in": self.blocks_swapped_in,
            "blocks_copied": self.blocks_copied,
            "evictions": self.evictions,
        }


def check_table_invariants(alloc: BlockTableAllocator) -> None:
    """What every block-table allocator keeps: ref counts equal table references,
    `tokens_used` sums the held blocks' fill, the host pool obeys the same rules,
    and no table is longer than max_model_len needs."""
    assert _refs(alloc.tables, alloc.num_blocks) == alloc.ref_count, (
        "device ref counts differ from block-table references"
    )
    free = set(alloc.free_list)
    assert len(free) == len(alloc.free_list), "a block is twice in the free list"
    for block in range(alloc.num_blocks):
        assert 0 <= alloc.fill[block] <= alloc.block_size
    used = sum(alloc.fill[b] for b in range(alloc.num_blocks) if alloc.ref_count[b] > 0)
    assert used == alloc.tokens_used, f"tokens_used {alloc.tokens_used} != {used}"
    assert not set(alloc.tables) & set(alloc.host_tables), "a sequence is on device and host"
    host_refs = _refs(alloc.host_tables, alloc.num_host_blocks)
    assert host_refs == alloc.host_ref_count, "host ref counts differ from host tables"
    host_free = set(alloc.host_free)
    assert len(host_free) == len(alloc.host_free), "a host block is twice in the free list"
    # the host pool is one budget: each block free, held by swapped sequences, or the tier's
    tier_held = alloc.tier_link.tier.host_blocks_held() if alloc.tier_link is not None else []
    assert len(set(tier_held)) == len(tier_held), "the tier holds a host block twice"
    assert not host_free & set(tier_held), "a host block is both free and the tier's"
    for block in range(alloc.num_host_blocks):
        unheld = block in host_free or block in tier_held
        assert unheld == (host_refs[block] == 0), f"host block {block}"
    for seq_id, table in alloc.tables.items():
        assert len(table) <= cdiv(alloc.max_model_len, alloc.block_size), (
            f"sequence {seq_id} holds more blocks than max_model_len needs"
        )


def _refs(tables: dict[int, list[int]], num_blocks: int) -> list[int]:
    """How many of the tables hold each block."""
    refs = [0] * num_blocks
    for table in tables.values():
        for block in table:
            refs[block] += 1
    return refs


class EvictionOrder:
    """Which cached block goes when a free block is needed: the policy half of
    `paged`'s prefix cache, a documented base to subclass (docs/plugins.md).

    The cache holds blocks no table references any more but whose content a
    later prompt may reuse. `PagedAllocator` tells the order: `add(block)` when a
    cached block's last holder lets it go (it becomes evictable), `remove(block)`
    when a new sequence holds it again, `hit(block)` for every block a new
    sequence's prefix reuses (held or not), and asks `evict()` for the block to
    reuse when the plain free list is empty. `len`, `in` and iteration list the
    evictable blocks. This default is LRU (vLLM's and SGLang's): the block let go
    longest ago goes first."""

    def __init__(self) -> None:
        self.blocks: OrderedDict[int, None] = OrderedDict()  # least recently let go first

    def add(self, block: int) -> None:
        self.blocks[block] = None

    def remove(self, block: int) -> None:
        del self.blocks[block]

    def hit(self, block: int) -> None:
        """A prefix hit on `block` (LRU needs none: `remove` and `add` keep the order)."""

    def evict(self) -> int:
        return self.blocks.popitem(last=False)[0]

    def __len__(self) -> int:
        return len(self.blocks)

    def __contains__(self, block: object) -> bool:
        return block in self.blocks

    def __iter__(self):
        return iter(self.blocks)


class PagedAllocator(BlockTableAllocator):
    """`paged`. Its cache's eviction order is `eviction_order()`'s: a subclass
    that returns another `EvictionOrder` changes which cached block goes first
    (LFU, a cost-aware order) and nothing else."""

    description = "fixed-size blocks on demand; optional hashed prefix sharing; copy-on-write forks"

    def __init__(
        self,
        token_capacity: int,
        host_token_capacity: int,
        max_model_len: int,
        block_size: int = 16,
        prefix_caching: bool = False,
    ) -> None:
        if not isinstance(block_size, int) or block_size < 1:
            raise ConfigError(
                f"allocator block_size must be a positive integer, got {block_size!r}"
            )
        super().__init__(token_capacity, host_token_capacity, max_model_len, block_size)
        self.prefix_caching = bool(prefix_caching)
        self.block_hash: list[int | None] = [None] * self.num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * self.num_blocks
        self.hash_to_block: dict[int, int] = {}
        self.free_cached: EvictionOrder = self.eviction_order()  # evictable cached blocks
        self.seq_hashes: dict[int, list[int]] = {}  # chain hashes of a sequence's full blocks
        # sequences whose next write may land in a block another table shares
        # (after a fork or a swap-in); an allocate() settles it with copy-on-write
        self.may_share_tail: set[int] = set()

    def eviction_order(self) -> EvictionOrder:
        """The order the cache evicts in (LRU); override to change it."""
        return EvictionOrder()

    # -- the cache's block states
    def _take_free(self) -> int:
        if self.free_list:
            block = self.free_list.popleft()
        else:
            block = self.free_cached.evict()
            self.evictions += 1
            if self.tier_link is not None:
                self.tier_link.evicted(self.block_hash[block], self.block_tokens[block], block)
            self._unpublish(block)
        self.ref_count[block] = 1
        return block

    def _unpublish(self, block: int) -> None:
        h = self.block_hash[block]
        if h is not None and self.hash_to_block.get(h) == block:
            del self.hash_to_block[h]
        self.block_hash[block] = None
        self.block_tokens[block] = None
        self.fill[block] = 0

    def _uncache(self, block: int) -> None:
        self.free_cached.remove(block)

    def _keep_cached(self, block: int) -> bool:
        if self.block_hash[block] is None:
            return False
        self.free_cached.add(block)
        return True

    # -- prefix cache
    def _chain_hash(self, parent, tokens: tuple[int, ...]):
        # with a KV tier, the tier's key: a block below is found by the same chain
        if self.tier_link is not None:
            return block_key(parent, tokens)
        return hash((parent, tokens))

    def _matched_blocks(self, seq: Sequence) -> list[int]:
        # prompt logprobs need every prompt position computed: no cached prefix (as vLLM)
        if not self.prefix_caching or seq.params.prompt_logprobs is not None:
            return []
        bs = self.block_size
        blocks: list[int] = []
        parent = None
        for i in range((seq.num_tokens - 1) // bs):  # leave at least one token to compute
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            h = self._chain_hash(parent, tokens)
            block = self.hash_to_block.get(h)
            if block is None or self.block_tokens[block] != tokens:
                break
            blocks.append(block)
            parent = h
        return blocks

    def _attach(self, seq: Sequence) -> list[int]:
        matched = self._matched_blocks(seq)
        for block in matched:
            self.free_cached.hit(block)
            self._revive(block)
        self.seq_hashes[seq.seq_id] = [self.block_hash[b] for b in matched]
        return matched

    def _publish(self, seq: Sequence, table: list[int]) -> bool:
        """Hashes the sequence's full, computed blocks not hashed yet and publishes
        each under its chain hash unless an equal block already is (the table
        keeps its own copy: False)."""
        if not self.prefix_caching:
            return False
        bs = self.block_size
        hashes = self.seq_hashes.setdefault(seq.seq_id, [])
        for i in range(len(hashes), seq.num_computed_tokens // bs):
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            h = self._chain_hash(hashes[-1] if hashes else None, tokens)
            hashes.append(h)
            block = table[i]
            if h not in self.hash_to_block and self.block_hash[block] is None:
                self.hash_to_block[h] = block
                self.block_hash[block] = h
                self.block_tokens[block] = tokens
                if self.tier_link is not None:
                    self.tier_link.completed(h, tokens, block)
        return False

    # -- a KV tier below the cache
    def attach_tier(self, tier: KVTier) -> None:
        if not self.prefix_caching:
            raise ConfigError(
                "a KV tier keeps the prefix cache's evicted blocks, and allocator "
                f"{getattr(self, 'name', 'paged')!r} has prefix_caching off; set "
                "allocator.prefix_caching=true (or use allocator=radix, or kv_tier=none)"
            )
        super().attach_tier(tier)

    def _block_key(self, block: int) -> bytes:
        return self.block_hash[block]

    def _adopt_loaded(self, seq: Sequence, table: list[int], start: int, keys: list[bytes]) -> None:
        bs, hashes = self.block_size, self.seq_hashes[seq.seq_id]
        for i, key in enumerate(keys, start):
            block = table[i]
            hashes.append(key)
            if key not in self.hash_to_block:  # published like any computed block
                self.hash_to_block[key] = block
                self.block_hash[block] = key
                self.block_tokens[block] = tuple(seq.token_ids[i * bs : (i + 1) * bs])

    # -- the decode fast path
    def extend_decodes(self, seqs: list[Sequence], rows: list[int]) -> list[int] | None:
        # a decoding sequence writes into its own last block unless a fork or a
        # swap-in may have left that block shared (then copy-on-write: general path)
        if len(rows) > self.num_free_blocks:
            return None
        if self.may_share_tail and any(s.seq_id in self.may_share_tail for s in seqs):
            return None
        blocks = []
        for row in rows:
            block = self._take_free()
            self.tables[seqs[row].seq_id].append(block)
            blocks.append(block)
        return blocks

    def commit_decodes(
        self, seqs: list[Sequence], written_blocks: list[int], filled_rows: list[int]
    ) -> bool:
        # the written blocks are private (extend_decodes made sure): one token each.
        # `filled_upto` may lag now; `commit` catches up idempotently.
        fill = self.fill
        for block in written_blocks:
            fill[block] += 1
        self.tokens_used += len(written_blocks)
        if self.prefix_caching:
            for row in filled_rows:
                seq = seqs[row]
                self._publish(seq, self.tables[seq.seq_id])
        return False  # an equal block cached first leaves this one private: tables stay

    # -- per-sequence state beyond the block table
    def allocate(self, seq: Sequence, num_tokens: int) -> int:
        cached = super().allocate(seq, num_tokens)
        self.may_share_tail.discard(seq.seq_id)
        return cached

    def free(self, seq: Sequence) -> None:
        super().free(seq)
        self.seq_hashes.pop(seq.seq_id, None)
        self.may_share_tail.discard(seq.seq_id)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        super().fork(parent, child)
        self.seq_hashes[child.seq_id] = list(self.seq_hashes.get(parent.seq_id, []))
        self.may_share_tail.update((parent.seq_id, child.seq_id))

    def _swapped_in(self, seq: Sequence) -> None:
        self.may_share_tail.add(seq.seq_id)

    # -- figures
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_list) + len(self.free_cached)

    def check_integrity(self) -> None:
        """The block-table rules (`check_table_invariants`), every block free xor
        referenced, and the prefix-cache map and the fill counts agree (tests call
        this after every step)."""
        check_table_invariants(self)
        free_plain, free_cached = set(self.free_list), set(self.free_cached)
        assert not free_plain & free_cached, "a block is both plain-free and cached-free"
        for block in range(self.num_blocks):
            is_free = block in free_plain or block in free_cached
            assert is_free == (self.ref_count[block] == 0), f"block {block}: free xor referenced"
            if block in free_plain:
                assert self.block_hash[block] is None and self.fill[block] == 0, f"block {block}"
            if block in free_cached:
                assert self.block_hash[block] is not None, f"cached-free block {block} has no hash"
        for h, block in self.hash_to_block.items():
            assert self.block_hash[block] == h, f"hash map points to block {block} of another hash"
            assert self.fill[block] == self.block_size, f"published block {block} is not full"


@hookimpl
def servelab_register_allocators():
    return {"paged": PagedAllocator}
