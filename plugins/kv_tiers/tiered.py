"""`tiered`: host memory over a disk (SGLang's HiCache with a storage backend).

A block the device cache lets go is copied to both (`policy` as for `host`;
the disk keeps what host memory has to drop, and what a restart needs); a
lookup asks host memory first, then the disk. Each level keeps its own
capacity and least-recently-used order (`host_capacity_*`, `disk_capacity_*`),
host memory its share of the swap pool. Its figures are the two levels' summed,
and `host_hits` / `disk_hits` say which served.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from servelab.contracts.hookspecs import hookimpl
from servelab.contracts.kv_tier import DEFAULT_FOLDER, HostBlocks, KVTier, TierFigures
from servelab.plugins.kv_tiers.disk import DiskTier
from servelab.plugins.kv_tiers.host import HostTier
from servelab.step.plan import BlockCopies


class TieredTier(KVTier):
    description = "host memory over a disk folder: host first, the disk below (and after restarts)"

    def __init__(
        self,
        block_bytes: int,
        kv_identity: dict[str, Any],
        payloads: bool,
        path: str = DEFAULT_FOLDER,
        host_capacity_blocks: int | None = None,
        host_capacity_bytes: int | str | None = None,
        disk_capacity_blocks: int | None = None,
        disk_capacity_bytes: int | str | None = None,
        policy: str = "write_back",
    ) -> None:
        super().__init__(block_bytes, kv_identity, payloads)
        self.host_level = HostTier(
            block_bytes, kv_identity, payloads, host_capacity_blocks, host_capacity_bytes, policy
        )
        self.disk_level = DiskTier(
            block_bytes, kv_identity, payloads, path, disk_capacity_blocks, disk_capacity_bytes,
            policy,
        )  # fmt: skip
        self.write_through = self.host_level.write_through

    # its counts are the levels' (each counts what it loads and stores) plus its misses
    @property  # type: ignore[override]
    def figures(self) -> TierFigures:
        total = TierFigures(misses=self._misses)
        for level in (self.host_level, self.disk_level):
            for f in fields(TierFigures):
                setattr(total, f.name, getattr(total, f.name) + getattr(level.figures, f.name))
        return total

    @figures.setter
    def figures(self, value: TierFigures) -> None:
        self._misses = value.misses  # the base class's start

    def missed(self, num_blocks: int) -> None:
        self._misses += num_blocks

    def bind(self, host: HostBlocks | None) -> None:
        super().bind(host)
        self.host_level.bind(host)

    def holds(self, key: bytes) -> bool:
        return self.host_level.holds(key) or self.disk_level.holds(key)

    def load(self, key: bytes, tokens: tuple[int, ...], block: int) -> bool:
        return self.host_level.load(key, tokens, block) or self.disk_level.load(key, tokens, block)

    def store(self, key: bytes, tokens: tuple[int, ...], block: int) -> None:
        self.host_level.store(key, tokens, block)
        self.disk_level.store(key, tokens, block)

    def host_blocks_held(self) -> list[int]:
        return self.host_level.host_blocks_held()

    def reclaimable_host_blocks(self) -> int:
        return self.host_level.reclaimable_host_blocks()

    def reclaim_host_blocks(self, num_blocks: int) -> int:
        return self.host_level.reclaim_host_blocks(num_blocks)

    def take_copies(self) -> BlockCopies:
        copies = self.host_level.take_copies()
        copies.extend(self.disk_level.take_copies())
        return copies

    def stats(self) -> dict[str, float]:
        return super().stats() | {
            "host_blocks": len(self.host_level.entries),
            "disk_blocks": len(self.disk_level.index),
            "host_hits": self.host_level.figures.hits,
            "disk_hits": self.disk_level.figures.hits,
        }

    def check_integrity(self) -> None:
        self.host_level.check_integrity()
        self.disk_level.check_integrity()


@hookimpl
def servelab_register_kv_tiers():
    return {"tiered": TieredTier}
