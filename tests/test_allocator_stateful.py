"""Stateful property test of every registered allocator, alone.

A shadow KV store follows the allocator's block tables and copies: every
"computed" token is written into its slot, copies are replayed, and after each
action every sequence's computed tokens must read back from its own blocks.
That catches a missed copy-on-write, a prefix-cache hit on wrong content, a
swap that loses a block, and a leaked or double-freed block
(`check_integrity()`).
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from servelab.plugin_manager import registered
from servelab.sequence import SamplingParams, Sequence

MAX_MODEL_LEN = 32
ALLOCATOR_CASES = [
    ("paged", {"block_size": 4}),
    ("paged", {"block_size": 1}),
    ("paged", {"block_size": 4, "prefix_caching": True}),
    ("paged", {"block_size": 3, "prefix_caching": True}),
    ("contiguous", {}),
]
# prompts drawn from a few shared prefixes so the prefix cache gets hits
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5, 5]]


def build(name: str, options: dict, token_capacity: int, host_capacity: int):
    cls = registered("allocator")[name].cls
    return cls(
        token_capacity=token_capacity,
        host_token_capacity=host_capacity,
        max_model_len=MAX_MODEL_LEN,
        **options,
    )


class AllocatorMachine(RuleBasedStateMachine):
    name = "paged"
    options: dict = {}

    def __init__(self) -> None:
        super().__init__()
        capacity = 3 * MAX_MODEL_LEN if self.name == "contiguous" else 40
        self.alloc = build(self.name, self.options, capacity, capacity)
        bs = self.alloc.block_size
        self.device = {b: [None] * bs for b in range(self.alloc.num_blocks)}
        self.host = {b: [None] * bs for b in range(self.alloc.num_host_blocks)}
        self.on_device: list[Sequence] = []
        self.on_host: list[list[Sequence]] = []

    # -- shadow KV
    def replay(self) -> None:
        copies = self.alloc.take_copies()
        for dev, host in copies.swap_out:
            self.host[host] = list(self.device[dev])
        for host, dev in copies.swap_in:
            self.device[dev] = list(self.host[host])
        for src, dst in copies.copy:
            self.device[dst] = list(self.device[src])

    def compute(self, seq: Sequence, upto: int) -> None:
        bs = self.alloc.block_size
        table = self.alloc.block_table(seq)
        for p in range(seq.num_computed_tokens, upto):
            self.device[table[p // bs]][p % bs] = seq.token_ids[p]
        seq.num_computed_tokens = upto
        self.alloc.commit(seq)

    def grow(self, seq: Sequence, upto: int) -> bool:
        if not self.alloc.can_allocate(seq, upto):
            return False
        cached = self.alloc.allocate(seq, upto)
        seq.num_computed_tokens = max(seq.num_computed_tokens, cached)
        self.replay()
        self.compute(seq, upto)
        return True

    # -- actions
    @rule(prefix=st.sampled_from(PREFIXES), tail=st.lists(st.integers(0, 3), max_size=6))
    def admit(self, prefix, tail):
        seq = Sequence("r", prefix + tail, SamplingParams())
        if self.grow(seq, seq.num_tokens):
            self.on_device.append(seq)

    @precondition(lambda self: self.on_device)
    @rule(data=st.data(), extra=st.lists(st.integers(0, 3), min_size=1, max_size=5))
    def append(self, data, extra):
        seq = data.draw(st.sampled_from(self.on_device))
        if seq.num_tokens + len(extra) > MAX_MODEL_LEN:
            return
        seq.token_ids += extra
        if not self.grow(seq, seq.num_tokens):
            del seq.token_ids[-len(extra) :]

    @precondition(lambda self: self.on_device)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self.on_device))
        child = parent.fork(1, parent.params)
        self.alloc.fork(parent, child)
        self.on_device.append(child)

    @precondition(lambda self: self.on_device)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(self.on_device))
        self.on_device.remove(seq)
        self.alloc.free(seq)

    @precondition(lambda self: self.on_device)
    @rule(data=st.data())
    def swap_out(self, data):
        group = data.draw(
            st.lists(st.sampled_from(self.on_device), min_size=1, max_size=2, unique=True)
        )
        if self.alloc.can_swap_out(group):
            self.alloc.swap_out(group)
            self.replay()
            for seq in group:
                self.on_device.remove(seq)
            self.on_host.append(group)

    @precondition(lambda self: self.on_host)
    @rule(data=st.data())
    def swap_in(self, data):
        group = data.draw(st.sampled_from(self.on_host))
        if self.alloc.can_swap_in(group):
            self.alloc.swap_in(group)
            self.replay()
            self.on_host.remove(group)
            self.on_device.extend(group)

    @precondition(lambda self: self.on_host)
    @rule(data=st.data())
    def abort_swapped(self, data):
        group = data.draw(st.sampled_from(self.on_host))
        self.on_host.remove(group)
        for seq in group:
            self.alloc.free(seq)

    # -- invariants
    @invariant()
    def integrity(self):
        self.alloc.check_integrity()

    @invariant()
    def every_sequence_reads_its_own_tokens(self):
        bs = self.alloc.block_size
        for seq in self.on_device:
            table = self.alloc.block_table(seq)
            stored = [self.device[table[p // bs]][p % bs] for p in range(seq.num_computed_tokens)]
            assert stored == seq.token_ids[: seq.num_computed_tokens], f"{seq} reads wrong K/V"

    def teardown(self):
        for group in self.on_host:
            for seq in group:
                self.alloc.free(seq)
        for seq in self.on_device:
            self.alloc.free(seq)
        self.alloc.check_integrity()
        usage = self.alloc.usage()
        assert usage["blocks_free"] == self.alloc.num_blocks, "device blocks leaked"
        assert usage["host_blocks_free"] == self.alloc.num_host_blocks, "host blocks leaked"


@pytest.mark.parametrize("name,options", ALLOCATOR_CASES, ids=lambda x: str(x))
def test_allocator_state_machine(name, options):
    machine = type(f"Machine_{name}", (AllocatorMachine,), {"name": name, "options": options})
    machine.TestCase.settings = settings(
        max_examples=60,
        stateful_step_count=30,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    machine.TestCase().runTest()


def test_every_registered_allocator_is_covered():
    assert {name for name, _ in ALLOCATOR_CASES} == set(registered("allocator"))
