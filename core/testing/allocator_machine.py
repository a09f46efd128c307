"""A stateful property test for any `KVAllocator`, alone (no engine, no torch).

A shadow KV store follows the allocator's block tables and copies: every
"computed" token is written into its slot, copies are replayed, and after each
action every sequence's computed tokens must read back from its own blocks.
That catches a missed copy-on-write, a prefix-cache hit on wrong content, a
swap that loses a block, and a leaked or double-freed block
(`check_integrity()`, and every block free once every sequence is freed).

With a KV tier attached (`tier`: a function of the allocator's block size that
makes one), the tier's copies are replayed too, its payloads being the shadow
blocks' tokens: a load of another prefix's block reads back wrong tokens. The
host pool must stay one budget: each host block free, swapped or the tier's.

    run_allocator_machine(PagedAllocator, {"block_size": 4})
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from servelab.contracts.allocator import KVAllocator
from servelab.contracts.kv_tier import KVTier
from servelab.step.sequence import SamplingParams, Sequence
from servelab.testing.deps import require

hypothesis = require("hypothesis", "the allocator state machine")
st = require("hypothesis.strategies", "the allocator state machine")
stateful = require("hypothesis.stateful", "the allocator state machine")
precondition, rule, invariant = stateful.precondition, stateful.rule, stateful.invariant

MAX_MODEL_LEN = 32
SMALL_CAPACITY = 40  # tokens: a few blocks, so allocation and swapping run out of room
MIN_BLOCKS = 3  # fewer blocks than this at SMALL_CAPACITY: size from max_model_len instead
# prompts drawn from a few shared prefixes so the prefix cache gets hits
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5, 5]]


def build_allocator(cls: type, options: dict[str, Any], capacity: int | None = None) -> Any:
    """`cls(**options)` with equal device and host capacity (tokens): `capacity`,
    or `SMALL_CAPACITY` unless that leaves fewer than `MIN_BLOCKS` blocks (a
    large-block allocator, e.g. one `max_model_len` slot per sequence), then
    three sequences' worth."""

    def make(tokens: int) -> Any:
        return cls(
            token_capacity=tokens,
            host_token_capacity=tokens,
            max_model_len=MAX_MODEL_LEN,
            **options,
        )

    if capacity is not None:
        return make(capacity)
    try:
        allocator = make(SMALL_CAPACITY)
    except Exception:  # e.g. ConfigError: smaller than one max_model_len sequence
        allocator = None
    if allocator is None or allocator.num_blocks < MIN_BLOCKS:
        allocator = make(3 * MAX_MODEL_LEN)
    return allocator


class AllocatorMachine(stateful.RuleBasedStateMachine):
    """Subclassed per allocator by `machine_for` (class attributes `cls`, `options`, `capacity`)."""

    cls: type
    options: dict = {}
    capacity: int | None = None
    make_tier: Callable[[int], KVTier] | None = None  # block size -> a tier to attach

    def __init__(self) -> None:
        super().__init__()
        self.alloc = build_allocator(self.cls, self.options, self.capacity)
        bs = self.alloc.block_size
        self.tier = None
        if self.make_tier is not None:
            self.tier = type(self).make_tier(bs)
            self.alloc.attach_tier(self.tier)
        self.device = {b: [None] * bs for b in range(self.alloc.num_blocks)}
        self.host = {b: [None] * bs for b in range(getattr(self.alloc, "num_host_blocks", 0))}
        self.on_device: list[Sequence] = []
        self.on_host: list[list[Sequence]] = []
        self.freed: list[list[int]] = []  # tokens of sequences freed: a later turn repeats one

    # -- shadow KV
    def replay(self) -> None:
        """Runs the queued copies in the executor's order (`BlockCopies`)."""
        copies = self.alloc.take_copies()
        for dev, host in copies.tier_out:
            self.host[host] = list(self.device[dev])
        for dev, sink in copies.tier_save:
            sink(self.payload(self.device[dev]))
        for dev, host in copies.swap_out:
            self.host[host] = list(self.device[dev])
        for host, dev in copies.tier_in:
            self.device[dev] = list(self.host[host])
        for source, dev in copies.tier_fetch:
            self.device[dev] = self.unpayload(source())
        for host, dev in copies.swap_in:
            self.device[dev] = list(self.host[host])
        for src, dst in copies.copy:
            self.device[dst] = list(self.device[src])

    @staticmethod
    def payload(block: list) -> Any:
        """A shadow block as an executor hands K/V to a tier's storage: a tensor of
        the K/V layout ([2, layers, block_size, heads, head_dim]), tokens as values."""
        import torch

        values = [-1 if t is None else t for t in block]
        return torch.tensor(values, dtype=torch.float64).reshape(1, 1, len(values), 1, 1)

    @staticmethod
    def unpayload(kv: Any) -> list:
        return [None if t < 0 else int(t) for t in kv.reshape(-1).tolist()]

    def write(self, seq: Sequence, upto: int) -> None:
        """The forward: the sequence's tokens up to `upto` land in its slots."""
        bs = self.alloc.block_size
        table = self.alloc.block_table(seq)
        for p in range(seq.num_computed_tokens, upto):
            self.device[table[p // bs]][p % bs] = seq.token_ids[p]
        seq.num_computed_tokens = upto

    def commit(self, seq: Sequence) -> None:
        """The update: the allocator commits; a table it says it kept is unchanged."""
        before = list(self.alloc.block_table(seq))
        if not self.alloc.commit(seq):
            assert self.alloc.block_table(seq) == before, "commit rewrote a table, said it did not"

    def compute(self, seq: Sequence, upto: int) -> None:
        self.write(seq, upto)
        self.commit(seq)

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

    @rule(
        prefix=st.sampled_from(PREFIXES),
        tails=st.lists(st.lists(st.integers(0, 3), max_size=6), min_size=2, max_size=3),
    )
    def admit_together(self, prefix, tails):
        """Prompts prefilled in one step: each is allocated before any computes, so
        none finds the others' shared prefix cached (a prefix cache may keep one
        copy of it when they commit)."""
        together = []
        for tail in tails:
            seq = Sequence("r", prefix + tail, SamplingParams())
            if not self.alloc.can_allocate(seq, seq.num_tokens):
                break
            seq.num_computed_tokens = self.alloc.allocate(seq, seq.num_tokens)
            together.append(seq)
        self.replay()
        for seq in together:
            self.write(seq, seq.num_tokens)
        for seq in together:
            self.commit(seq)
        self.on_device += together

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
    @rule(
        data=st.data(),
        drafts=st.lists(st.integers(0, 3), min_size=1, max_size=5),
        accepted=st.integers(0, 5),
    )
    def speculate(self, data, drafts, accepted):
        """A decode with drafts (speculative decoding): room for the drafts, their
        K/V written, then only `accepted` of them kept: the rest are rolled back
        (`truncate`) before the commit, and the target's own token, which differs
        from the first rejected draft, follows the kept ones (not computed yet)."""
        seq = data.draw(st.sampled_from(self.on_device))
        before, end = seq.num_tokens, seq.num_tokens + len(drafts)
        if end >= MAX_MODEL_LEN or not self.alloc.can_allocate(seq, end):
            return
        self.alloc.allocate(seq, end)
        self.replay()
        seq.token_ids += drafts
        self.write(seq, end)
        keep = min(accepted, len(drafts))
        del seq.token_ids[before + keep :]
        seq.num_computed_tokens = before + keep
        self.alloc.truncate(seq, seq.num_computed_tokens)
        if type(self.alloc).truncate is not KVAllocator.truncate:  # it releases: exactly
            held, needed = (
                len(self.alloc.block_table(seq)),
                -(-(before + keep) // self.alloc.block_size),
            )
            assert held == needed, f"truncate kept {held} blocks, the kept tokens need {needed}"
        self.commit(seq)
        seq.token_ids.append((drafts[keep] + 1) % 4 if keep < len(drafts) else 0)

    @precondition(lambda self: self.on_device)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self.on_device))
        child = parent.fork(1, parent.params)
        self.alloc.fork(parent, child)
        self.on_device.append(child)

    @precondition(lambda self: self.freed)
    @rule(data=st.data(), tail=st.lists(st.integers(0, 3), max_size=4))
    def readmit(self, data, tail):
        """A later turn: a freed sequence's tokens again, maybe with more after them
        (its prefix may still be cached, or evicted and kept below)."""
        tokens = data.draw(st.sampled_from(self.freed)) + tail
        seq = Sequence("r", tokens[:MAX_MODEL_LEN], SamplingParams())
        if self.grow(seq, seq.num_tokens):
            self.on_device.append(seq)

    @precondition(lambda self: self.on_device)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(self.on_device))
        self.on_device.remove(seq)
        self.freed.append(list(seq.token_ids[: seq.num_computed_tokens]))
        self.alloc.free(seq)

    @precondition(lambda self: len(self.on_device) > 1)
    @rule()
    def drain(self):
        """Every running sequence finishes (a batch ends): the cache holds only what it keeps."""
        for seq in self.on_device:
            self.freed.append(list(seq.token_ids[: seq.num_computed_tokens]))
            self.alloc.free(seq)
        self.on_device.clear()

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
        if self.tier is not None:
            self.tier.check_integrity()

    @invariant()
    def host_memory_is_one_budget(self):
        """Swapped blocks, the tier's and the free ones never exceed the host pool."""
        alloc = self.alloc
        if self.tier is None or not hasattr(alloc, "host_free"):
            return
        swapped = {b for table in alloc.host_tables.values() for b in table}
        tier = self.tier.host_blocks_held()
        assert len(swapped) + len(tier) + len(alloc.host_free) == alloc.num_host_blocks, (
            f"host blocks: {len(swapped)} swapped + {len(tier)} in the tier + "
            f"{len(alloc.host_free)} free != the pool's {alloc.num_host_blocks}"
        )

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
        held = self.alloc.num_blocks - usage["blocks_free"]
        assert held == 0, f"{held} device blocks leaked after every sequence was freed"
        host_held = getattr(self.alloc, "num_host_blocks", 0) - usage["host_blocks_free"]
        assert host_held == 0, f"{host_held} host blocks leaked after every sequence was freed"


def machine_for(
    cls: type,
    options: dict[str, Any] | None = None,
    capacity: int | None = None,
    tier: Callable[[int], KVTier] | None = None,
) -> type[AllocatorMachine]:
    """An `AllocatorMachine` subclass bound to one allocator class and its options
    (and a KV tier below it: `tier(block_size)` makes one per run)."""
    attrs = {"cls": cls, "options": dict(options or {}), "capacity": capacity}
    if tier is not None:
        attrs["make_tier"] = staticmethod(tier)
    return type(f"{cls.__name__}Machine", (AllocatorMachine,), attrs)


def run_allocator_machine(
    cls: type,
    options: dict[str, Any] | None = None,
    *,
    capacity: int | None = None,
    max_examples: int = 60,
    steps: int = 30,
    tier: Callable[[int], KVTier] | None = None,
    derandomize: bool = False,
) -> None:
    """Runs the state machine on `cls(**options)` (with a KV tier from `tier`);
    hypothesis raises (with the shrunk sequence of actions) on the first broken
    property. `derandomize`: the same examples every run."""
    machine = machine_for(cls, options, capacity, tier)
    settings = hypothesis.settings(
        derandomize=derandomize,
        max_examples=max_examples,
        stateful_step_count=steps,
        deadline=None,
        suppress_health_check=list(hypothesis.HealthCheck),
    )
    stateful.run_state_machine_as_test(machine, settings=settings)
