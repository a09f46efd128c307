"""The invariants of the radix allocator, asserted by `check_integrity`: every
block is free, held or cached (in the tree, held by no table), exactly one; the tree's runs, keys and block map
agree; a sequence's tree pages are exactly its path from the root; a node no
table holds has no held descendant (so leaf eviction can reach every cached
block); and the block-table rules (`check_table_invariants`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from servelab.plugins.allocators.block_table import check_table_invariants

if TYPE_CHECKING:
    from servelab.plugins.allocators.radix import RadixAllocator


def check_radix_invariants(alloc: RadixAllocator) -> None:
    check_table_invariants(alloc)
    _check_blocks(alloc)
    _check_tree(alloc)
    _check_paths(alloc)


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
