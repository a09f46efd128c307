"""Stateful property test of every registered allocator, alone.

The state machine lives in `servelab.testing.allocator_machine` (shared with
the conformance kit): a shadow KV store follows the allocator's block tables
and copies, and after each action every sequence's computed tokens must read
back from its own blocks. That catches a missed copy-on-write, a prefix-cache
hit on wrong content, a swap that loses a block, and a leaked or double-freed
block (`check_integrity()`).
"""

from __future__ import annotations

import pytest

from servelab.registry.plugin_manager import registered
from servelab.testing.allocator_machine import run_allocator_machine

ALLOCATOR_CASES = [
    ("paged", {"block_size": 4}),
    ("paged", {"block_size": 1}),
    ("paged", {"block_size": 4, "prefix_caching": True}),
    ("paged", {"block_size": 3, "prefix_caching": True}),
    ("contiguous", {}),
    ("radix", {"page_size": 1}),
    ("radix", {"page_size": 2}),
    ("radix", {"page_size": 3}),
]


@pytest.mark.parametrize("name,options", ALLOCATOR_CASES, ids=lambda x: str(x))
def test_allocator_state_machine(name, options):
    run_allocator_machine(registered("allocator")[name].cls, options, max_examples=60, steps=30)


def test_every_registered_allocator_is_covered():
    assert {name for name, _ in ALLOCATOR_CASES} == set(registered("allocator"))
