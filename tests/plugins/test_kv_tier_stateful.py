"""Stateful property test of the allocators with a KV tier below them.

The allocator state machine (`servelab.testing.allocator_machine`) replays the
tier's copies in its shadow KV store, so a load of another prefix's block reads
back wrong tokens; after every action the allocator's and the tier's integrity
hold and the host pool is one budget (swapped + the tier's + free blocks = the
pool); at the end no device or host block is held. Each case must also have
really loaded from the tier.
"""

from __future__ import annotations

import tempfile

import pytest

from servelab.registry.plugin_manager import registered
from servelab.testing.allocator_machine import run_allocator_machine

ALLOCATORS = [
    ("paged", {"block_size": 4, "prefix_caching": True}),
    ("paged", {"block_size": 3, "prefix_caching": True}),
    ("radix", {"page_size": 1}),
    ("radix", {"page_size": 2}),
]
HOST_TIERS = [
    {},
    {"capacity_blocks": 4},
    {"policy": "write_through"},
    {"policy": "write_through", "capacity_blocks": 16},
]


def tier_maker(name: str, options: dict, made: list, folder: str | None = None):
    cls = registered("kv_tier")[name].cls

    def make(block_size: int):
        if folder is not None:  # a fresh folder per run: no run starts warm from another's
            options["path"] = tempfile.mkdtemp(dir=folder)
        tier = cls(
            block_bytes=block_size * 8,
            kv_identity={"model": "shadow", "block_size": block_size},
            payloads=True,
            **options,
        )
        made.append(tier)
        return tier

    return make


@pytest.mark.parametrize("tier_options", HOST_TIERS, ids=str)
@pytest.mark.parametrize("name,options", ALLOCATORS, ids=str)
def test_host_tier_state_machine(name, options, tier_options):
    made: list = []
    run_allocator_machine(
        registered("allocator")[name].cls,
        options,
        capacity=36,  # tokens of device (and host) cache: a few blocks, so prefixes are evicted
        max_examples=50,
        steps=50,
        tier=tier_maker("host", tier_options, made),
        derandomize=True,  # the same runs each time: the hit count below is then fixed
    )
    assert sum(t.figures.hits for t in made) > 0, "no run loaded a block from the tier"


# below the host pool: files holding the shadow blocks' tokens, read back and checked
FILE_TIERS = [
    ("disk", {}),
    ("disk", {"policy": "write_back", "capacity_blocks": 6}),
    ("tiered", {"host_capacity_blocks": 3}),
]


@pytest.mark.parametrize("tier,tier_options", FILE_TIERS, ids=str)
@pytest.mark.parametrize("name,options", ALLOCATORS[::2], ids=str)
def test_file_tier_state_machine(name, options, tier, tier_options, tmp_path):
    made: list = []
    run_allocator_machine(
        registered("allocator")[name].cls,
        options,
        capacity=36,
        max_examples=30,
        steps=50,
        tier=tier_maker(tier, dict(tier_options), made, str(tmp_path)),
        derandomize=True,
    )
    assert sum(t.figures.hits for t in made) > 0, "no run loaded a block from the tier"
