"""`KVCache.apply` runs a KV tier's copies in `BlockCopies`' order: the tier's stores
read device blocks before anything the step writes into them (swap-in, the tier's
loads, copy-on-write), a store into the host pool waits for its download (as a
non-blocking CUDA copy into pinned memory must), and where one list writes a
block twice the later pair wins."""

from __future__ import annotations

import torch

from servelab.step.plan import BlockCopies
from tests.executor.test_swap_copies import DelayedCopies


def cache() -> DelayedCopies:
    kv = DelayedCopies(2, 6, 4, 2, 8, torch.float64, torch.device("cpu"), num_host_blocks=4)
    kv.device_pool.copy_(torch.randn(kv.device_pool.shape, dtype=torch.float64))
    return kv


def test_stores_read_a_block_before_the_step_writes_into_it():
    kv = cache()
    evicted = kv.device_pool[:, :, 2].clone()
    kept: list[torch.Tensor] = []
    kv.host_pool[:, :, 1] = 7.0
    # block 2 is evicted (stored to host block 0 and to a sink) and reused in the same step:
    # a load from host block 1 lands in it, and a copy-on-write reads it afterwards
    kv.apply(
        BlockCopies(
            tier_out=[(2, 0)],
            tier_save=[(2, lambda block: kept.append(block.clone()))],
            tier_in=[(1, 2)],
            copy=[(2, 5)],
        )
    )
    assert torch.equal(kv.host_pool[:, :, 0], evicted)
    assert torch.equal(kept[0], evicted)
    assert (kv.device_pool[:, :, 2] == 7.0).all() and (kv.device_pool[:, :, 5] == 7.0).all()


def test_a_fetch_writes_its_source_and_the_later_of_two_writes_wins():
    kv = cache()
    first = torch.full(kv.device_pool[:, :, 0].shape, 1.0, dtype=torch.float64)
    second = torch.full_like(first, 2.0)
    kv.apply(BlockCopies(tier_fetch=[(lambda: first, 3), (lambda: second, 3), (lambda: first, 4)]))
    assert (kv.device_pool[:, :, 3] == 2.0).all() and (kv.device_pool[:, :, 4] == 1.0).all()
    kv.host_pool[:, :, 0], kv.host_pool[:, :, 1] = 5.0, 6.0
    kv.apply(BlockCopies(tier_in=[(0, 1), (1, 1)]))
    assert (kv.device_pool[:, :, 1] == 6.0).all()
