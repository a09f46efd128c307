"""`host`: evicted prefix blocks kept in host memory, least recently used out first
(vLLM's CPU offloading, SGLang's HiCache host tier).

Its blocks are the swap pool's (`engine.swap_space`), lent by the allocator: one
host budget for swapped-out sequences and the tier, and swap comes first (a
swap-out takes the tier's blocks back, dropping those entries). A block is
copied down when the device cache evicts it (`policy: write_back`, the default)
or as soon as it is computed (`write_through`: more copies, but an evicted
block is already below). `capacity_blocks` or `capacity_bytes` caps the tier's
share of the pool; null lets it take every free block.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, NamedTuple

from servelab.contracts.hookspecs import hookimpl
from servelab.contracts.kv_tier import HostBlocks, KVTier
from servelab.errors import ConfigError
from servelab.plugins.kv_tiers.options import capacity_of, write_through
from servelab.step.plan import BlockCopies


class HostEntry(NamedTuple):
    host_block: int
    tokens: tuple[int, ...]


class HostTier(KVTier):
    description = (
        "host memory, one budget with swap (engine.swap_space); LRU; write_back or write_through"
    )

    def __init__(
        self,
        block_bytes: int,
        kv_identity: dict[str, Any],
        payloads: bool,
        capacity_blocks: int | None = None,
        capacity_bytes: int | str | None = None,
        policy: str = "write_back",
    ) -> None:
        super().__init__(block_bytes, kv_identity, payloads)
        self.write_through = write_through("host", policy)
        self.capacity = capacity_of("host", capacity_blocks, capacity_bytes, block_bytes)
        self.entries: OrderedDict[bytes, HostEntry] = OrderedDict()  # least recently used first
        self.pinned: set[bytes] = set()  # loaded from this step: kept until the copies leave
        self.copies = BlockCopies()

    def bind(self, host: HostBlocks | None) -> None:
        if host is None or host.num_blocks == 0:
            raise ConfigError(
                "kv_tier 'host' keeps blocks in the host pool engine.swap_space sizes, which "
                "holds no block here; raise engine.swap_space (it is one budget for swap and "
                "the tier)"
            )
        super().bind(host)

    # -- lookups and loads
    def holds(self, key: bytes) -> bool:
        return key in self.entries

    def load(self, key: bytes, tokens: tuple[int, ...], block: int) -> bool:
        entry = self.entries.get(key)
        if entry is None or entry.tokens != tokens:
            return False
        self.entries.move_to_end(key)
        self.pinned.add(key)
        self.copies.tier_in.append((entry.host_block, block))
        self.figures.hit(self.block_size, self.block_bytes)
        return True

    # -- stores and room
    def store(self, key: bytes, tokens: tuple[int, ...], block: int) -> None:
        if key in self.entries:
            self.entries.move_to_end(key)
            return
        host_block = self._room()
        if host_block is None:
            self.figures.blocks_dropped += 1
            return
        self.entries[key] = HostEntry(host_block, tokens)
        self.copies.tier_out.append((block, host_block))
        self.figures.blocks_stored += 1
        self.figures.bytes_stored += self.block_bytes

    def _room(self) -> int | None:
        """A host block for a new entry: a free one of the pool while under capacity,
        else the least recently used entry's; None when every entry is pinned."""
        if self.capacity is None or len(self.entries) < self.capacity:
            assert self.host is not None  # bind refused a tier without a pool
            block = self.host.take()
            if block is not None:
                return block
        return self._evict_one()

    def _evict_one(self) -> int | None:
        for key in self.entries:
            if key not in self.pinned:
                self.figures.blocks_evicted += 1
                return self.entries.pop(key).host_block
        return None

    # -- the pool, shared with swap
    def host_blocks_held(self) -> list[int]:
        return [entry.host_block for entry in self.entries.values()]

    def reclaimable_host_blocks(self) -> int:
        return len(self.entries) - len(self.pinned)

    def reclaim_host_blocks(self, num_blocks: int) -> int:
        assert self.host is not None
        given = 0
        while given < num_blocks:
            block = self._evict_one()
            if block is None:
                break
            self.host.give(block)
            given += 1
        return given

    # -- copies and figures
    def take_copies(self) -> BlockCopies:
        copies, self.copies = self.copies, BlockCopies()
        self.pinned.clear()
        return copies

    def stats(self) -> dict[str, float]:
        return super().stats() | {"host_blocks": len(self.entries)}

    def check_integrity(self) -> None:
        """Host blocks distinct and in the pool, within capacity; pins are entries."""
        held = self.host_blocks_held()
        assert len(set(held)) == len(held), "two host-tier entries share a host block"
        if self.host is not None:
            assert all(0 <= b < self.host.num_blocks for b in held), "a host block outside the pool"
        if self.capacity is not None:
            assert len(self.entries) <= self.capacity, "the host tier exceeds its capacity"
        assert self.pinned <= self.entries.keys(), "a pinned entry was evicted"


@hookimpl
def servelab_register_kv_tiers():
    return {"host": HostTier}
