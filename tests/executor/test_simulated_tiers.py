"""The simulated executor prices a KV tier's copies by link: blocks to or from host
memory cross the device's host link (its hardware profile's bandwidth, PCIe's
latency); to or from a tier's own storage (a disk) they also cross an NVMe drive
(`servelab.cluster.links`). Loads are the tier's load time; stores and loads move
the virtual clock."""

from __future__ import annotations

import pytest

from servelab import LLM
from servelab.cluster.links import LINKS, STORAGE_LINKS
from servelab.step.plan import BlockCopies


@pytest.fixture(scope="module")
def executor():
    llm = LLM(model="llama3-8b", executor="simulated", hardware="h100-sxm", dtype="bfloat16",
              allocator={"name": "paged", "prefix_caching": True}, kv_tier="host",
              kv_cache_memory="1GiB", swap_space="1GiB", max_model_len=2048)  # fmt: skip
    return llm.engine.executor


def test_tier_copies_are_priced_by_link(executor):
    block = executor.block_bytes
    assert block == 16 * 128 * 1024  # 16 tokens of Llama-3-8B's K/V in bf16
    host = executor.profile.host_link_bandwidth
    pcie, nvme = LINKS["pcie"], STORAGE_LINKS["nvme"]
    assert executor.tier_copy_time(3, 0) == pytest.approx(pcie.latency_s + 3 * block / host)
    assert executor.tier_copy_time(0, 2) == pytest.approx(
        pcie.latency_s + 2 * block / host + nvme.transfer_seconds(2 * block)
    )
    assert executor.tier_copy_time(0, 0) == 0.0


def test_apply_moves_the_clock_and_counts_loads_and_stores_apart(executor):
    before, loaded_before = executor.now(), executor.tier_load_seconds
    stored_before = executor.tier_store_seconds
    fetch = [(lambda: None, 7)]
    executor.apply(BlockCopies(tier_out=[(1, 0)], tier_in=[(0, 2)], tier_fetch=fetch))
    stores, loads = executor.tier_copy_time(1, 0), executor.tier_copy_time(1, 1)
    assert executor.now() - before == pytest.approx(stores + loads)
    assert executor.tier_load_seconds - loaded_before == pytest.approx(loads)
    assert executor.tier_store_seconds - stored_before == pytest.approx(stores)
