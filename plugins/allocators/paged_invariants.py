"""The invariants of the paged allocator, asserted by `check_integrity` (tests
call it after every step): the block-table rules (`check_table_invariants`),
every block is free xor referenced, and the prefix-cache map and the fill
counts agree."""

from __future__ import annotations

from typing import TYPE_CHECKING

from servelab.plugins.allocators.block_table import check_table_invariants

if TYPE_CHECKING:
    from servelab.plugins.allocators.paged import PagedAllocator


def check_paged_invariants(alloc: PagedAllocator) -> None:
    check_table_invariants(alloc)
    free_plain, free_cached = set(alloc.free_list), set(alloc.free_cached)
    assert not free_plain & free_cached, "a block is both plain-free and cached-free"
    for block in range(alloc.num_blocks):
        is_free = block in free_plain or block in free_cached
        assert is_free == (alloc.ref_count[block] == 0), f"block {block}: free xor referenced"
        if block in free_plain:
            assert alloc.block_hash[block] is None and alloc.fill[block] == 0, f"block {block}"
        if block in free_cached:
            assert alloc.block_hash[block] is not None, f"cached-free block {block} has no hash"
    for h, block in alloc.hash_to_block.items():
        assert alloc.block_hash[block] == h, f"hash map points to block {block} of another hash"
        assert alloc.fill[block] == alloc.block_size, f"published block {block} is not full"
