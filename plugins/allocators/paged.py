"""`paged`: fixed-size KV blocks from a free list, allocated on demand (vLLM's
PagedAttention), with optional prefix caching and copy-on-write forks.

Prefix caching: a full, computed block is published under a chain hash
`hash((parent_hash, tokens))`; a later sequence whose leading tokens hash the
same reuses the physical block (ref count +1) after a token comparison guards
against collisions. A freed block that holds a hash stays reusable in an LRU
list and is evicted only when a plain free block is needed.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from servelab.contracts.allocator import KVAllocator
from servelab.contracts.hookspecs import hookimpl
from servelab.errors import ConfigError
from servelab.plugins.allocators.paged_invariants import check_paged_invariants
from servelab.step.plan import BlockCopies
from servelab.step.sequence import Sequence


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class PagedAllocator(KVAllocator):
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
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.prefix_caching = bool(prefix_caching)
        self.num_blocks = token_capacity // block_size
        if self.num_blocks * block_size < max_model_len:
            raise ConfigError(
                f"KV cache too small: its memory (kv_cache_memory, or what gpu_memory_utilization "
                f"leaves) holds {token_capacity} tokens ({self.num_blocks} blocks of {block_size}), "
                f"less than one sequence of max_model_len={max_model_len} tokens; raise that "
                "memory or lower max_model_len"
            )
        self.num_host_blocks = host_token_capacity // block_size
        # device blocks
        self.ref_count = [0] * self.num_blocks
        self.fill = [0] * self.num_blocks  # tokens whose K/V the block holds
        self.block_hash: list[int | None] = [None] * self.num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * self.num_blocks
        self.hash_to_block: dict[int, int] = {}
        self.free_plain: deque[int] = deque(range(self.num_blocks))
        self.free_cached: OrderedDict[int, None] = OrderedDict()  # LRU first
        self.tables: dict[int, list[int]] = {}
        self.seq_hashes: dict[int, list[int]] = {}  # chain hashes of a sequence's full blocks
        self.filled_upto: dict[int, int] = {}  # tokens of the sequence reflected in `fill`
        # sequences whose next write may land in a block another table shares
        # (after a fork or a swap-in); an allocate() settles it with copy-on-write
        self.may_share_tail: set[int] = set()
        self.tokens_used = 0  # sum of fill over referenced blocks
        # host pool
        self.host_ref_count = [0] * self.num_host_blocks
        self.host_free: deque[int] = deque(range(self.num_host_blocks))
        self.host_tables: dict[int, list[int]] = {}
        self.host_fill: dict[int, int] = {}  # host block -> fill
        # figures
        self.copies = BlockCopies()
        self.prefix_hit_tokens = 0
        self.prefix_query_tokens = 0
        self.blocks_swapped_out = 0
        self.blocks_swapped_in = 0
        self.blocks_copied = 0

    # -- block primitives
    def _take_free(self) -> int:
        if self.free_plain:
            block = self.free_plain.popleft()
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

    def _revive(self, block: int) -> None:
        """Takes one more reference to a block found in the prefix cache."""
        if self.ref_count[block] == 0:
            del self.free_cached[block]
            self.tokens_used += self.fill[block]
        self.ref_count[block] += 1

    def _release(self, block: int) -> None:
        self.ref_count[block] -= 1
        if self.ref_count[block] == 0:
            self.tokens_used -= self.fill[block]
            if self.block_hash[block] is not None:
                self.free_cached[block] = None  # most recently used end
            else:
                self.fill[block] = 0
                self.free_plain.append(block)

    def _set_fill(self, block: int, tokens: int) -> None:
        if tokens > self.fill[block]:
            self.tokens_used += tokens - self.fill[block]
            self.fill[block] = tokens

    # -- prefix cache
    def _chain_hash(self, parent: int | None, tokens: tuple[int, ...]) -> int:
        return hash((parent, tokens))

    def _match_blocks(self, seq: Sequence) -> list[int]:
        if not self.prefix_caching:
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

    def match_prefix(self, seq: Sequence) -> int:
        return len(self._match_blocks(seq)) * self.block_size

    def commit(self, seq: Sequence) -> None:
        table = self.tables.get(seq.seq_id)
        if table is None:
            return
        bs = self.block_size
        computed = seq.num_computed_tokens
        start = self.filled_upto.get(seq.seq_id, 0)
        for i in range(start // bs, cdiv(computed, bs)):
            self._set_fill(table[i], min(bs, computed - i * bs))
        self.filled_upto[seq.seq_id] = computed
        if self.prefix_caching:
            self._publish_full_blocks(seq, table)

    def _publish_full_blocks(self, seq: Sequence, table: list[int]) -> None:
        """Hashes the sequence's full, computed blocks not hashed yet and publishes
        each under its chain hash unless an equal block already is."""
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
    ) -> None:
        # the written blocks are private (extend_decodes made sure): one token each.
        # `filled_upto` may lag now; `commit` catches up idempotently.
        fill = self.fill
        for block in written_blocks:
            fill[block] += 1
        self.tokens_used += len(written_blocks)
        if self.prefix_caching:
            for row in filled_rows:
                seq = seqs[row]
                self._publish_full_blocks(seq, self.tables[seq.seq_id])

    # -- allocation
    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        table = self.tables.get(seq.seq_id)
        if table is None:
            matched = self._match_blocks(seq)
            reclaimed = sum(1 for b in matched if self.ref_count[b] == 0)
            return max(0, cdiv(num_tokens, self.block_size) - len(matched)) + reclaimed
        return max(0, cdiv(num_tokens, self.block_size) - len(table)) + self._cow_needed(seq, table)

    def blocks_needed_together(self, requests: list[tuple[Sequence, int]]) -> int:
        # the last of k writers into a block that only they share keeps it: k - 1 copies
        need = 0
        writers: dict[int, int] = {}
        for seq, num_tokens in requests:
            table = self.tables.get(seq.seq_id)
            if table is None:
                need += self.blocks_needed(seq, num_tokens)
                continue
            need += max(0, cdiv(num_tokens, self.block_size) - len(table))
            index = seq.num_computed_tokens // self.block_size
            if index < len(table) and self.ref_count[table[index]] > 1:
                writers[table[index]] = writers.get(table[index], 0) + 1
        for block, count in writers.items():
            need += count if self.ref_count[block] > count else count - 1
        return need

    def _cow_needed(self, seq: Sequence, table: list[int]) -> int:
        index = seq.num_computed_tokens // self.block_size
        return int(index < len(table) and self.ref_count[table[index]] > 1)

    def allocate(self, seq: Sequence, num_tokens: int) -> int:
        if not self.can_allocate(seq, num_tokens):
            raise RuntimeError(
                f"allocate({seq}, {num_tokens}) without room; call can_allocate first"
            )
        cached = 0
        table = self.tables.get(seq.seq_id)
        if table is None:
            table = self.tables[seq.seq_id] = []
            matched = self._match_blocks(seq)
            for block in matched:
                self._revive(block)
            table.extend(matched)
            cached = len(matched) * self.block_size
            self.seq_hashes[seq.seq_id] = [self.block_hash[b] for b in matched]
            self.filled_upto[seq.seq_id] = cached
            if self.prefix_caching:
                self.prefix_hit_tokens += cached
                self.prefix_query_tokens += seq.num_tokens
        elif self._cow_needed(seq, table):
            self._copy_on_write(seq, table)
        while len(table) < cdiv(num_tokens, self.block_size):
            table.append(self._take_free())
        self.may_share_tail.discard(seq.seq_id)
        return cached

    def _copy_on_write(self, seq: Sequence, table: list[int]) -> None:
        index = seq.num_computed_tokens // self.block_size
        src = table[index]
        dst = self._take_free()
        self.copies.copy.append((src, dst))
        self.blocks_copied += 1
        self._set_fill(dst, self.fill[src])
        self.ref_count[src] -= 1  # still > 0: another table holds it
        table[index] = dst

    def free(self, seq: Sequence) -> None:
        table = self.tables.pop(seq.seq_id, None)
        if table is not None:
            for block in reversed(table):  # tail blocks become the first evicted
                self._release(block)
        self.seq_hashes.pop(seq.seq_id, None)
        self.filled_upto.pop(seq.seq_id, None)
        self.may_share_tail.discard(seq.seq_id)
        for block in self.host_tables.pop(seq.seq_id, []):
            self._release_host(block)

    def block_table(self, seq: Sequence) -> list[int]:
        return self.tables[seq.seq_id]

    def fork(self, parent: Sequence, child: Sequence) -> None:
        table = self.tables[parent.seq_id]
        for block in table:
            self.ref_count[block] += 1
        self.tables[child.seq_id] = list(table)
        self.seq_hashes[child.seq_id] = list(self.seq_hashes.get(parent.seq_id, []))
        self.filled_upto[child.seq_id] = self.filled_upto.get(parent.seq_id, 0)
        self.may_share_tail.update((parent.seq_id, child.seq_id))

    # -- swapping
    def _release_host(self, block: int) -> None:
        self.host_ref_count[block] -= 1
        if self.host_ref_count[block] == 0:
            self.host_fill.pop(block, None)
            self.host_free.append(block)

    def _distinct(self, tables: list[list[int]]) -> set[int]:
        return {b for t in tables for b in t}

    def can_swap_out(self, seqs: list[Sequence]) -> bool:
        blocks = self._distinct([self.tables[s.seq_id] for s in seqs])
        return len(blocks) <= len(self.host_free)

    def swap_out(self, seqs: list[Sequence]) -> None:
        to_host: dict[int, int] = {}
        for seq in seqs:
            host_table = []
            for block in self.tables[seq.seq_id]:
                if block not in to_host:
                    host = self.host_free.popleft()
                    to_host[block] = host
                    self.host_fill[host] = self.fill[block]
                    self.copies.swap_out.append((block, host))
                self.host_ref_count[to_host[block]] += 1
                host_table.append(to_host[block])
            for block in reversed(self.tables.pop(seq.seq_id)):
                self._release(block)
            self.host_tables[seq.seq_id] = host_table
        self.blocks_swapped_out += len(to_host)

    def can_swap_in(self, seqs: list[Sequence]) -> bool:
        blocks = self._distinct([self.host_tables[s.seq_id] for s in seqs])
        return len(blocks) <= self.num_free_blocks

    def swap_in(self, seqs: list[Sequence]) -> None:
        to_device: dict[int, int] = {}
        for seq in seqs:
            table = []
            for host in self.host_tables.pop(seq.seq_id):
                if host not in to_device:
                    block = self._take_free()
                    to_device[host] = block
                    self._set_fill(block, self.host_fill[host])
                    self.copies.swap_in.append((host, block))
                else:
                    self.ref_count[to_device[host]] += 1
                table.append(to_device[host])
                self._release_host(host)
            self.tables[seq.seq_id] = table
            self.may_share_tail.add(seq.seq_id)
        self.blocks_swapped_in += len(to_device)

    def take_copies(self) -> BlockCopies:
        copies, self.copies = self.copies, BlockCopies()
        return copies

    # -- figures
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_plain) + len(self.free_cached)

    def usage(self) -> dict[str, float]:
        return {
            "tokens_used": self.tokens_used,
            "tokens_reserved": (self.num_blocks - self.num_free_blocks) * self.block_size,
            "tokens_capacity": self.num_blocks * self.block_size,
            "blocks_free": self.num_free_blocks,
            "blocks_total": self.num_blocks,
            "host_blocks_free": len(self.host_free),
            "host_blocks_total": self.num_host_blocks,
            "prefix_hit_tokens": self.prefix_hit_tokens,
            "prefix_query_tokens": self.prefix_query_tokens,
            "blocks_swapped_out": self.blocks_swapped_out,
            "blocks_swapped_in": self.blocks_swapped_in,
            "blocks_copied": self.blocks_copied,
        }

    def check_integrity(self) -> None:
        check_paged_invariants(self)


@hookimpl
def servelab_register_allocators():
    return {"paged": PagedAllocator}
