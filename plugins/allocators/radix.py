"""`radix`: a radix-tree prefix cache over paged KV (SGLang's RadixAttention).

Blocks of `page_size` tokens (default 1: a match ends at any token). Every
full page a sequence computes is inserted into a radix tree (`radix_tree`)
under the path of pages it holds, prompt and output alike, so a later request
that repeats any prefix of it (the next turn of a chat, a shared few-shot
example) reuses those blocks, up to the last page boundary before its final
token. Pages another sequence cached while this one computed them too (two
prompts with a shared prefix prefilled in one step) are kept once: the table
takes the cached blocks and frees its copies. A block's ref count is the
number of block tables holding it: tree blocks with none are the cache,
evicted least-recently-used leaf first when a free block is needed. A write into a
shared or cached block copies it first; block tables, forks and the host pool are
`paged`'s `BlockTableAllocator`.
Written against the public contract only.
"""

from __future__ import annotations

from servelab.contracts.hookspecs import hookimpl
from servelab.contracts.kv_tier import block_key
from servelab.errors import ConfigError
from servelab.plugins.allocators.paged import BlockTableAllocator, check_table_invariants
from servelab.plugins.allocators.radix_tree import Node, RadixTree
from servelab.step.sequence import Sequence


class RadixAllocator(BlockTableAllocator):
    description = (
        "radix-tree prefix cache over paged KV: any-page matches, LRU leaves (RadixAttention)"
    )
    prefix_caching = True  # always: the tree is the cache (figures and benchmarks read this)

    def __init__(
        self,
        token_capacity: int,
        host_token_capacity: int,
        max_model_len: int,
        page_size: int = 1,
        prefix_caching: bool = True,
    ) -> None:
        # accepted so that one sweep can set prefix_caching for paged and radix alike
        if prefix_caching is not True:
            raise ConfigError(
                "radix allocator: the tree is the prefix cache; prefix_caching must be true"
            )
        if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 1:
            raise ConfigError(
                f"radix allocator: page_size must be an integer >= 1, got {page_size!r}"
            )
        super().__init__(token_capacity, host_token_capacity, max_model_len, page_size)
        self.tree = RadixTree(page_size)
        self.num_evictable = 0  # cached blocks no table holds
        # leading pages of a sequence's table that are its path in the tree; None:
        # it stopped publishing (its path went through a copy, or it was swapped out)
        self.tree_pages: dict[int, int | None] = {}
        # with a KV tier: each tree block's tier key (the chain of its path's pages)
        self.block_keys: dict[int, bytes] = {}

    # -- the cache's block states
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
            raise RuntimeError("no free block and nothing to evict; check blocks_needed first")
        leaf = min(leaves, key=lambda n: n.last_access)
        self.tree.remove_leaf(leaf)
        if self.tier_link is not None:
            page = self.block_size
            for i, block in enumerate(leaf.blocks):
                key, tokens = self.block_keys.pop(block), leaf.key[i * page : (i + 1) * page]
                self.tier_link.evicted(key, tokens, block)
        for block in leaf.blocks:
            self.fill[block] = 0
            self.free_list.append(block)
        self.num_evictable -= len(leaf.blocks)
        self.evictions += len(leaf.blocks)

    def _uncache(self, block: int) -> None:
        self.num_evictable -= 1

    def _keep_cached(self, block: int) -> bool:
        if block not in self.tree.node_of_block:
            return False
        self.num_evictable += 1  # stays cached until evicted
        return True

    def _pinned(self, block: int) -> bool:
        return block in self.tree.node_of_block

    # -- the prefix cache
    def _match(self, seq: Sequence) -> list[tuple[Node, int]]:
        if seq.params.prompt_logprobs is not None:  # every prompt position computed (as vLLM)
            return []
        return self.tree.match(seq.token_ids, seq.num_tokens - 1)  # leave one token to compute

    @staticmethod
    def _blocks(path: list[tuple[Node, int]]) -> list[int]:
        return [b for node, pages in path for b in node.blocks[:pages]]

    def _matched_blocks(self, seq: Sequence) -> list[int]:
        return self._blocks(self._match(seq))

    def _publish(self, seq: Sequence, table: list[int]) -> bool:
        """Inserts the sequence's full computed pages past its tree path. Pages
        another sequence cached first (two prompts with a shared prefix in one
        step) are shared instead (`_share_cached`). True when that rewrote the table."""
        done = self.tree_pages.get(seq.seq_id)
        full = min(seq.num_computed_tokens // self.block_size, len(table))
        if done is None or full <= done:
            return False
        tree, page = self.tree, self.block_size
        # the common case, once per step of a decoding sequence: nobody cached these
        # tokens, they hang under the end of the sequence's own path (no walk from the root)
        parent = tree.root if done == 0 else tree.node_of_block.get(table[done - 1])
        key = tuple(seq.token_ids[done * page : full * page])
        blocks = table[done:full]
        if (
            parent is not None
            and (parent is tree.root or parent.blocks[-1] == table[done - 1])
            and key[:page] not in parent.children
            and not any(b in tree.node_of_block for b in blocks)
        ):
            self._hang(parent, key, blocks)
            self.tree_pages[seq.seq_id] = full
            return False
        return self._share_cached(seq, table, done, full)

    def _share_cached(self, seq: Sequence, table: list[int], done: int, full: int) -> bool:
        """`_publish` where the tree already holds some of the pages past the
        sequence's path: its table takes those cached blocks and frees its own
        copies, and its remaining pages hang under them, as SGLang's cache does."""
        tree, page = self.tree, self.block_size
        path = tree.match(seq.token_ids, full * page)
        cached = self._blocks(path)
        if cached[:done] != table[:done]:  # never expected: its pages are its tree path
            self.tree_pages[seq.seq_id] = None
            return False
        rewrote = False
        for i in range(done, len(cached)):
            if table[i] != cached[i]:
                self._revive(cached[i])
                self._release(table[i])
                table[i] = cached[i]
                rewrote = True
        if path and path[-1][1] < len(path[-1][0].blocks):
            tree.split(*path[-1])  # its path must end a run: later pages hang there
        parent = path[-1][0] if path else tree.root
        matched = len(cached)
        if matched < full:
            self._hang(
                parent, tuple(seq.token_ids[matched * page : full * page]), table[matched:full]
            )
        else:
            tree.touch(parent)
        self.tree_pages[seq.seq_id] = full
        return rewrote

    def _hang(self, parent: Node, key: tuple[int, ...], blocks: list[int]) -> None:
        """New pages under `parent`, whose children start with none of them."""
        tree = self.tree
        if self.tier_link is not None:
            self._key_pages(parent, key, blocks)
        if (
            parent is not tree.root
            and not parent.children
            and self.ref_count[parent.blocks[-1]] == 1
        ):
            tree.extend(parent, key, blocks)  # a leaf only this sequence holds: grow its run
        else:
            tree.insert(parent, key, blocks)

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

    # -- a KV tier below the tree
    def _key_pages(self, parent: Node, key: tuple[int, ...], blocks: list[int]) -> None:
        """Keys the pages hung under `parent`; a write-through tier keeps each now."""
        page, link = self.block_size, self.tier_link
        assert link is not None
        chain = None if parent is self.tree.root else self.block_keys[parent.blocks[-1]]
        for i, block in enumerate(blocks):
            tokens = key[i * page : (i + 1) * page]
            chain = self.block_keys[block] = block_key(chain, tokens)
            link.completed(chain, tokens, block)

    def _block_key(self, block: int) -> bytes:
        return self.block_keys[block]

    def _adopt_loaded(self, seq: Sequence, table: list[int], start: int, keys: list[bytes]) -> None:
        """Hangs the loaded pages under the sequence's tree path (`_attach` made it end a run)."""
        parent = self.tree.node_of_block[table[start - 1]] if start else self.tree.root
        page = self.block_size
        self._hang(parent, tuple(seq.token_ids[start * page : len(table) * page]), table[start:])
        self.tree_pages[seq.seq_id] = len(table)

    # -- per-sequence tree paths
    def _copy_on_write(self, seq: Sequence, table: list[int]) -> int:
        index = super()._copy_on_write(seq, table)
        pages = self.tree_pages.get(seq.seq_id)
        if pages is not None and pages > index:
            self.tree_pages[seq.seq_id] = None  # its path no longer runs through the copy
        return index

    def free(self, seq: Sequence) -> None:
        table = self.tables.get(seq.seq_id)
        pages = self.tree_pages.pop(seq.seq_id, None)
        if table is not None and pages:  # its prefix was just used: evicted last
            self.tree.touch(self.tree.node_of_block[table[pages - 1]])
        super().free(seq)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        super().fork(parent, child)
        self.tree_pages[child.seq_id] = self.tree_pages.get(parent.seq_id)

    def _swapped_out(self, seq: Sequence) -> None:
        self.tree_pages[seq.seq_id] = None  # it comes back in private blocks

    # -- figures
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_list) + self.num_evictable

    def usage(self) -> dict[str, float]:
        return super().usage() | {"blocks_cached": len(self.tree.node_of_block)}

    def check_integrity(self) -> None:
        """Every block is free, held or cached (in the tree, held by no table),
        exactly one; the tree's runs, keys and block map agree; a sequence's tree
        pages are exactly its path from the root; a node no table holds has no held
        descendant (so leaf eviction can reach every cached block); and the
        block-table rules (`check_table_invariants`)."""
        check_table_invariants(self)
        _check_blocks(self)
        _check_tree(self)
        _check_paths(self)
        if self.tier_link is not None:
            assert self.block_keys.keys() == self.tree.node_of_block.keys(), "tier keys != tree"


@hookimpl
def servelab_register_allocators():
    return {"radix": RadixAllocator}


# -- the invariants `check_integrity` asserts


def _check_blocks(alloc: RadixAllocator) -> None:
    free = set(alloc.free_list)
    cached = alloc.tree.node_of_block
    for block in range(alloc.num_blocks):
        held = alloc.ref_count[block] > 0
        states = (block in free) + held + (block in cached and not held)
        assert states == 1, f"block {block}: not exactly one of free, held, cached"
        if block in free:
            assert alloc.fill[block] == 0, f"free block {block} holds tokens"
    evictable = sum(1 for b in cached if alloc.ref_count[b] == 0)
    assert evictable == alloc.num_evictable, f"num_evictable {alloc.num_evictable} != {evictable}"


def _check_tree(alloc: RadixAllocator) -> None:
    tree, page, ref = alloc.tree, alloc.block_size, alloc.ref_count
    seen = 0
    for node in tree.nodes():
        assert node.blocks and len(node.key) == len(node.blocks) * page, (
            "a run and its blocks differ"
        )
        assert node.parent.children.get(node.key[:page]) is node, "a child under a wrong key"
        for block in node.blocks:
            assert tree.node_of_block.get(block) is node, f"block {block} maps to another node"
            assert alloc.fill[block] == page, f"cached block {block} is not full"
        seen += len(node.blocks)
        if node.parent is not tree.root and any(ref[b] for b in node.blocks):
            assert all(ref[b] for b in node.parent.blocks), "a held node under an unheld one"
    assert seen == len(tree.node_of_block), "the block map holds blocks outside the tree"


def _check_paths(alloc: RadixAllocator) -> None:
    tree = alloc.tree
    for seq_id, table in alloc.tables.items():
        pages = alloc.tree_pages.get(seq_id)
        if not pages:
            continue
        node = tree.node_of_block.get(table[pages - 1])
        assert node is not None and node.blocks[-1] == table[pages - 1], (
            f"sequence {seq_id}: its tree pages do not end a run"
        )
        assert tree.path_blocks(node) == table[:pages], f"sequence {seq_id}: not its tree path"
