"""The invariants of the radix allocator, asserted by `check_integrity`: ref
counts equal block-table references; every block is free, held or cached (in
the tree, held by no table), exactly one; the tree's runs, keys and block map
agree; a sequence's tree pages are exactly its path from the root; a node no
table holds has no held descendant (so leaf eviction can reach every cached
block); the host pool obeys the paged rules."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from servelab.plugins.allocators.radix import RadixAllocator


def check_radix_invariants(alloc: RadixAllocator) -> None:
    refs = [0] * alloc.num_blocks
    for table in alloc.tables.values():
        for block in table:
            refs[block] += 1
    assert refs == alloc.ref_count, "device ref counts differ from block-table references"
    _check_blocks(alloc)
    _check_tree(alloc)
    _check_paths(alloc)
    used = sum(alloc.fill[b] for b in range(alloc.num_blocks) if alloc.ref_count[b] > 0)
    assert used == alloc.tokens_used, f"tokens_used {alloc.tokens_used} != {used}"
    _check_host(alloc)
    for seq_id, table in alloc.tables.items():
        assert len(table) <= -(-alloc.max_model_len // alloc.block_size), (
            f"sequence {seq_id} holds more blocks than max_model_len needs"
        )


def _check_blocks(alloc: RadixAllocator) -> None:
    free = set(alloc.free_list)
    assert len(free) == len(alloc.free_list), "a block is twice in the free list"
    cached = alloc.tree.node_of_block
    for block in range(alloc.num_blocks):
        held = alloc.ref_count[block] > 0
        states = (block in free) + held + (block in cached and not held)
        assert states == 1, f"block {block}: not exactly one of free, held, cached"
        if block in free:
            assert alloc.fill[block] == 0, f"free block {block} holds tokens"
        assert 0 <= alloc.fill[block] <= alloc.block_size
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


def _check_host(alloc: RadixAllocator) -> None:
    assert not set(alloc.tables) & set(alloc.host_tables), "a sequence is on device and host"
    host_refs = [0] * alloc.num_host_blocks
    for table in alloc.host_tables.values():
        for block in table:
            host_refs[block] += 1
    assert host_refs == alloc.host_ref_count, "host ref counts differ from host tables"
    host_free = set(alloc.host_free)
    assert len(host_free) == len(alloc.host_free), "a host block is twice in the free list"
    for block in range(alloc.num_host_blocks):
        assert (block in host_free) == (host_refs[block] == 0), f"host block {block}"
