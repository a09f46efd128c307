"""`none`: no tier below the device cache (the default). An evicted prefix block
is gone and its tokens are prefilled again: the engine attaches nothing, so every
step is exactly one of an engine without tiers."""

from __future__ import annotations

from servelab.contracts.hookspecs import hookimpl
from servelab.contracts.kv_tier import KVTier
from servelab.step.plan import BlockCopies


class NoTier(KVTier):
    description = "no tier below the device cache: an evicted prefix is recomputed (the default)"
    keeps_blocks = False

    def holds(self, key: bytes) -> bool:
        return False

    def load(self, key: bytes, tokens: tuple[int, ...], block: int) -> bool:
        return False

    def store(self, key: bytes, tokens: tuple[int, ...], block: int) -> None:
        self.figures.blocks_dropped += 1

    def take_copies(self) -> BlockCopies:
        return BlockCopies()

    def check_integrity(self) -> None:
        pass


@hookimpl
def servelab_register_kv_tiers():
    return {"none": NoTier}
