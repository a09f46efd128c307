"""Swap-out reads its host copy only after the device-to-host copy finished:
a stand-in whose copies land only when waited for (as a non-blocking CUDA copy
into pinned memory does) still yields the right host blocks."""

from __future__ import annotations

import torch

from servelab.executor.kv_cache import KVCache
from servelab.step.plan import BlockCopies


class DelayedCopies(KVCache):
    """Downloads land only at `_wait_for_downloads`; read earlier, they are zeros."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []

    def _download(self, blocks):
        staged = torch.zeros_like(blocks)
        self.pending.append((staged, blocks.clone()))
        return staged

    def _wait_for_downloads(self):
        for staged, blocks in self.pending:
            staged.copy_(blocks)
        self.pending.clear()


def test_swap_out_waits_for_its_copy_before_reading_it():
    kv = DelayedCopies(2, 6, 4, 2, 8, torch.float32, torch.device("cpu"), num_host_blocks=3)
    kv.device_pool.copy_(torch.randn(kv.device_pool.shape))
    kv.apply(BlockCopies(swap_out=[(4, 0), (1, 2)]))
    assert torch.equal(kv.host_pool[:, :, 0], kv.device_pool[:, :, 4])
    assert torch.equal(kv.host_pool[:, :, 2], kv.device_pool[:, :, 1])
    assert not kv.host_pool[:, :, 1].any()  # nothing else written


def test_swap_round_trip_restores_the_blocks():
    kv = KVCache(2, 6, 4, 2, 8, torch.float32, torch.device("cpu"), num_host_blocks=2)
    kv.device_pool.copy_(torch.randn(kv.device_pool.shape))
    before = kv.device_pool[:, :, 3].clone()
    kv.apply(BlockCopies(swap_out=[(3, 1)]))
    kv.device_pool[:, :, 3] = 0
    kv.apply(BlockCopies(swap_in=[(1, 5)]))
    assert torch.equal(kv.device_pool[:, :, 5], before)
