"""`paged`: fixed-size KV blocks from a free list, allocated on demand (vLLM's
PagedAttention), with optional prefix caching and copy-on-write forks.

Prefix caching: a full, computed block is published under a chain hash
`hash((parent_hash, tokens))`; a later sequence whose leading tokens hash the
same reuses the physical block (ref count +1) after a token comparison guards
against collisions. A freed block that holds a hash stays reusable in an LRU
list and is evicted only when a plain free block is needed. The block tables,
forks and swapping are `block_table`'s.
"""

from __future__ import annotations

from collections import OrderedDict

from servelab.contracts.hookspecs import hookimpl
from servelab.errors import ConfigError
from servelab.plugins.allocators.block_table import BlockTableAllocator, check_table_invariants
from servelab.step.sequence import Sequence


class PagedAllocator(BlockTableAllocator):
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
        self.free_cached: OrderedDict[int, None] = OrderedDict()  # LRU first
        self.seq_hashes: dict[int, list[int]] = {}  # chain hashes of a sequence's full blocks
        # sequences whose next write may land in a block another table shares
        # (after a fork or a swap-in); an allocate() settles it with copy-on-write
        self.may_share_tail: set[int] = set()

    # -- the cache's block states
    def _take_free(self) -> int:
        if self.free_list:
            block = self.free_list.popleft()
        else:
            block, _ = self.free_cached.popitem(last=False)  # evict least recently used
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
        del self.free_cached[block]

    def _keep_cached(self, block: int) -> bool:
        if self.block_hash[block] is None:
            return False
        self.free_cached[block] = None  # most recently used end
        return True

    # -- prefix cache
    def _chain_hash(self, parent: int | None, tokens: tuple[int, ...]) -> int:
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
        return False

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
