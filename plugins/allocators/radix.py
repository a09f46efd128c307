"""`radix`: a radix-tree prefix cache over paged KV (SGLang's RadixAttention).

Blocks of `page_size` tokens (default 1: a match ends at any token). Every
full page a sequence computes is inserted into a radix tree (`radix_tree`)
under the path of pages it holds, prompt and output alike, so a later request
that repeats any prefix of it (the next turn of a chat, a shared few-shot
example) reuses those blocks, up to the last page boundary before its final
token. A block's ref count is the number of block tables holding it: tree
blocks with none are the cache, evicted least-recently-used leaf first when a
free block is needed. A write into a shared or cached block copies it first;
swapped blocks go to a host pool, as in `paged`. Written against the public
contract only.
"""

from __future__ import annotations

from collections import deque

from servelab.contracts.allocator import KVAllocator
from servelab.contracts.hookspecs import hookimpl
from servelab.errors import ConfigError
from servelab.plugins.allocators.radix_invariants import check_radix_invariants
from servelab.plugins.allocators.radix_tree import Node, RadixTree
from servelab.step.plan import BlockCopies
from servelab.step.sequence import Sequence


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class RadixAllocator(KVAllocator):
    description = (
        "radix-tree prefix cache over paged KV: any-page matches, LRU leaves (RadixAttention)"
    )
    prefix_caching = True  # always: the tree is the cache (figures and benchmarks read this)

    def __init__(
        self, token_capacity: int, host_token_capacity: int, max_model_len: int, page_size: int = 1
    ) -> None:
        if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 1:
            raise ConfigError(
                f"radix allocator: page_size must be an integer >= 1, got {page_size!r}"
            )
        self.block_size = page_size
        self.max_model_len = max_model_len
        self.num_blocks = token_capacity // page_size
        if self.num_blocks * page_size < max_model_len:
            raise ConfigError(
                f"KV cache too small: its memory holds {token_capacity} tokens, less than one "
                f"sequence of max_model_len={max_model_len} tokens; raise it or lower max_model_len"
            )
        self.num_host_blocks = host_token_capacity // page_size
        self.tree = RadixTree(page_size)
        self.ref_count = [0] * self.num_blocks
        self.fill = [0] * self.num_blocks  # tokens whose K/V the block holds
        self.free_list: deque[int] = deque(range(self.num_blocks))  # neither held nor cached
        self.num_evictable = 0  # cached blocks no table holds
        self.tables: dict[int, list[int]] = {}
        self.filled_upto: dict[int, int] = {}  # tokens of the sequence reflected in `fill`
        # leading pages of a sequence's table that are its path in the tree; None:
        # it stopped publishing (another sequence cached the same tokens first)
        self.tree_pages: dict[int, int | None] = {}
        self.tokens_used = 0
        self.host_ref_count = [0] * self.num_host_blocks
        self.host_free: deque[int] = deque(range(self.num_host_blocks))
        self.host_tables: dict[int, list[int]] = {}
        self.host_fill: dict[int, int] = {}
        self.copies = BlockCopies()
        self.prefix_hit_tokens = self.prefix_query_tokens = 0
        self.blocks_swapped_out = self.blocks_swapped_in = self.blocks_copied = 0

    # -- block primitives
    def _take_free(self) -> int:
        if not self.free_list:
            self._evict_lru_leaf()
        block = self.free_list.popleft()
        self.ref_count[block] = 1
        return block

    def _evict_lru_leaf(self) -> None:
        ref = self.ref_count
        leaves = [
            n for n in self.tree.nodes() if not n.children and all(ref[b] == 0 for b in n.blocks)
        ]
        if not leaves:
            raise RuntimeError("no free block and nothing to evict; call can_allocate first")
        leaf = min(leaves, key=lambda n: n.last_access)
        self.tree.remove_leaf(leaf)
        for block in leaf.blocks:
            self.fill[block] = 0
            self.free_list.append(block)
        self.num_evictable -= len(leaf.blocks)

    def _revive(self, block: int) -> None:
        """One more table holds a block found in the tree."""
        if self.ref_count[block] == 0:
            self.num_evictable -= 1
            self.tokens_used += self.fill[block]
        self.ref_count[block] += 1

    def _release(self, block: int) -> None:
        self.ref_count[block] -= 1
        if self.ref_count[block] == 0:
            self.tokens_used -= self.fill[block]
            if block in self.tree.node_of_block:
                self.num_evictable += 1  # stays cached until evicted
            else:
                self.fill[block] = 0
                self.free_list.append(block)

    def _set_fill(self, block: int, tokens: int) -> None:
        if tokens > self.fill[block]:
            self.tokens_used += tokens - self.fill[block]
            self.fill[block] = tokens

    # -- the prefix cache
    def _match(self, seq: Sequence) -> list[tuple[Node, int]]:
        return self.tree.match(seq.token_ids, seq.num_tokens - 1)  # leave one token to compute

    @staticmethod
    def _blocks(path: list[tuple[Node, int]]) -> list[int]:
        return [b for node, pages in path for b in node.blocks[:pages]]

    def match_prefix(self, seq: Sequence) -> int:
        return sum(pages for _, pages in self._match(seq)) * self.block_size

    def commit(self, seq: Sequence) -> None:
        table = self.tables.get(seq.seq_id)
        if table is None:
            return
        page, computed = self.block_size, seq.num_computed_tokens
        for i in range(self.filled_upto.get(seq.seq_id, 0) // page, cdiv(computed, page)):
            self._set_fill(table[i], min(page, computed - i * page))
        self.filled_upto[seq.seq_id] = computed
        self._publish(seq, table)

    def _publish(self, seq: Sequence, table: list[int]) -> None:
        """Inserts the sequence's full computed pages past its tree path."""
        done = self.tree_pages.get(seq.seq_id)
        full = min(seq.num_computed_tokens // self.block_size, len(table))
        if done is None or full <= done:
            return
        tree, page = self.tree, self.block_size
        parent = tree.root if done == 0 else tree.node_of_block[table[done - 1]]
        if parent is not tree.root and parent.blocks[-1] != table[done - 1]:
            self.tree_pages[seq.seq_id] = None  # its path ends inside a run: nowhere to hang pages
            return
        key = tuple(seq.token_ids[done * page : full * page])
        blocks = table[done:full]
        if key[:page] in parent.children or any(b in tree.node_of_block for b in blocks):
            self.tree_pages[seq.seq_id] = None  # cached by another sequence first: stop here
            return
        if (
            parent is not tree.root
            and not parent.children
            and self.ref_count[parent.blocks[-1]] == 1
        ):
            tree.extend(parent, key, blocks)  # a leaf only this sequence holds: grow its run
        else:
            tree.insert(parent, key, blocks)
        self.tree_pages[seq.seq_id] = full

    # -- allocation
    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        table = self.tables.get(seq.seq_id)
        if table is None:
            matched = self._blocks(self._match(seq))
            reclaimed = sum(1 for b in matched if self.ref_count[b] == 0)
            return max(0, cdiv(num_tokens, self.block_size) - len(matched)) + reclaimed
        return max(0, cdiv(num_tokens, self.block_size) - len(table)) + self._cow_needed(seq, table)

    def blocks_needed_together(self, requests: list[tuple[Sequence, int]]) -> int:
        # the last of k writers into a block only they share keeps it, unless it is cached
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
            keeps = self.ref_count[block] == count and block not in self.tree.node_of_block
            need += count - 1 if keeps else count
        return need

    def _cow_needed(self, seq: Sequence, table: list[int]) -> int:
        index = seq.num_computed_tokens // self.block_size
        if index >= len(table):
            return 0
        block = table[index]
        return int(self.ref_count[block] > 1 or block in self.tree.node_of_block)

    def allocate(self, seq: Sequence, num_tokens: int) -> int:
        if not self.can_allocate(seq, num_tokens):
            raise RuntimeError(
                f"allocate({seq}, {num_tokens}) without room; call can_allocate first"
            )
        cached = 0
        table = self.tables.get(seq.seq_id)
        if table is None:
            table = self.tables[seq.seq_id] = self._attach(seq)
            cached = len(table) * self.block_size
            self.filled_upto[seq.seq_id] = cached
            self.prefix_hit_tokens += cached
            self.prefix_query_tokens += seq.num_tokens
        elif self._cow_needed(seq, table):
            self._copy_on_write(seq, table)
        while len(table) < cdiv(num_tokens, self.block_size):
            table.append(self._take_free())
        return cached

    def _attach(self, seq: Sequence) -> list[int]:
        """The matched prefix's blocks, held (ref +1); a match ending inside an edge splits it."""
        path = self._match(seq)
        if path and path[-1][1] < len(path[-1][0].blocks):
            self.tree.split(*path[-1])
        blocks = self._blocks(path)
        for block in blocks:
            self._revive(block)
        if path:
            self.tree.touch(path[-1][0])
        self.tree_pages[seq.seq_id] = len(blocks)
        return blocks

    def _copy_on_write(self, seq: Sequence, table: list[int]) -> None:
        index = seq.num_computed_tokens // self.block_size
        src, dst = table[index], self._take_free()
        self.copies.copy.append((src, dst))
        self.blocks_copied += 1
        self._set_fill(dst, self.fill[src])
        self._release(src)
        table[index] = dst
        pages = self.tree_pages.get(seq.seq_id)
        if pages is not None and pages > index:
            self.tree_pages[seq.seq_id] = None  # its path no longer runs through the copy

    def free(self, seq: Sequence) -> None:
        table = self.tables.pop(seq.seq_id, None)
        if table is not None:
            pages = self.tree_pages.get(seq.seq_id)
            if pages:  # its prefix was just used: evicted last
                self.tree.touch(self.tree.node_of_block[table[pages - 1]])
            for block in reversed(table):
                self._release(block)
        self.tree_pages.pop(seq.seq_id, None)
        self.filled_upto.pop(seq.seq_id, None)
        for block in self.host_tables.pop(seq.seq_id, []):
            self._release_host(block)

    def block_table(self, seq: Sequence) -> list[int]:
        return self.tables[seq.seq_id]

    def fork(self, parent: Sequence, child: Sequence) -> None:
        table = self.tables[parent.seq_id]
        for block in table:
            self.ref_count[block] += 1
        self.tables[child.seq_id] = list(table)
        self.tree_pages[child.seq_id] = self.tree_pages.get(parent.seq_id)
        self.filled_upto[child.seq_id] = self.filled_upto.get(parent.seq_id, 0)

    # -- swapping
    def _release_host(self, block: int) -> None:
        self.host_ref_count[block] -= 1
        if self.host_ref_count[block] == 0:
            self.host_fill.pop(block, None)
            self.host_free.append(block)

    def can_swap_out(self, seqs: list[Sequence]) -> bool:
        blocks = {b for s in seqs for b in self.tables[s.seq_id]}
        return len(blocks) <= len(self.host_free)

    def swap_out(self, seqs: list[Sequence]) -> None:
        to_host: dict[int, int] = {}
        for seq in seqs:
            host_table = []
            for block in self.tables[seq.seq_id]:
                if block not in to_host:
                    to_host[block] = host = self.host_free.popleft()
                    self.host_fill[host] = self.fill[block]
                    self.copies.swap_out.append((block, host))
                self.host_ref_count[to_host[block]] += 1
                host_table.append(to_host[block])
            for block in reversed(self.tables.pop(seq.seq_id)):
                self._release(block)  # a cached block stays in the tree
            self.host_tables[seq.seq_id] = host_table
            self.tree_pages[seq.seq_id] = None  # it comes back in private blocks
        self.blocks_swapped_out += len(to_host)

    def can_swap_in(self, seqs: list[Sequence]) -> bool:
        blocks = {b for s in seqs for b in self.host_tables[s.seq_id]}
        return len(blocks) <= self.num_free_blocks

    def swap_in(self, seqs: list[Sequence]) -> None:
        to_device: dict[int, int] = {}
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
        self.blocks_swapped_in += len(to_device)

    def take_copies(self) -> BlockCopies:
        copies, self.copies = self.copies, BlockCopies()
        return copies

    # -- figures
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_list) + self.num_evictable

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
            "blocks_cached": len(self.tree.node_of_block),
        }

    def check_integrity(self) -> None:
        check_radix_invariants(self)


@hookimpl
def servelab_register_allocators():
    return {"radix": RadixAllocator}
