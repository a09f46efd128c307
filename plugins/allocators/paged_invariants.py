"""The invariants of the paged allocator, asserted by `check_integrity` (tests
call it after every step): ref counts equal block-table references, every
block is free xor referenced, the prefix-cache map and the fill counts agree,
and the host pool obeys the same rules."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from servelab.plugins.allocators.paged import PagedAllocator


def check_paged_invariants(alloc: PagedAllocator) -> None:
    refs = [0] * alloc.num_blocks
    for table in alloc.tables.values():
        for block in table:
            refs[block] += 1
    assert refs == alloc.ref_count, "device ref counts differ from block-table references"
    free_plain, free_cached = set(alloc.free_plain), set(alloc.free_cached)
    assert len(free_plain) == len(alloc.free_plain), "a block is twice in the free list"
    assert not free_plain & free_cached, "a block is both plain-free and cached-free"
    for block in range(alloc.num_blocks):
        is_free = block in free_plain or block in free_cached
        assert is_free == (alloc.ref_count[block] == 0), f"block {block}: free xor referenced"
        if block in free_plain:
            assert alloc.block_hash[block] is None and alloc.fill[block] == 0, f"block {block}"
        if block in free_cached:
            assert alloc.block_hash[block] is not None, f"cached-free block {block} has no hash"
        assert 0 <= alloc.fill[block] <= alloc.block_size
    for h, block in alloc.hash_to_block.items():
        assert alloc.block_hash[block] == h, f"hash map points to block {block} of another hash"
        assert alloc.fill[block] == alloc.block_size, f"published block {block} is not full"
    used = sum(alloc.fill[b] for b in range(alloc.num_blocks) if alloc.ref_count[b] > 0)
    assert used == alloc.tokens_used, f"tokens_used {alloc.tokens_used} != {used}"
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
    for seq_id, table in alloc.tables.items():
        assert len(table) <= -(-alloc.max_model_len // alloc.block_size), (
            f"sequence {seq_id} holds more blocks than max_model_len needs"
        )
