"""The KV tier contract: what happens to a prefix block the device cache evicts
(a copy kept one tier down, in host memory or on disk, or dropped), and how a
lookup below the device cache is answered.

The allocator keeps owning device blocks. It tells its tier about a full,
hashed prefix block when it evicts it (`store`; at completion instead for a
write-through tier), and on a new request's prefix lookup it asks the tier
about the blocks past its device match (`holds`, then `load` into a fresh
device block it allocated). A tier queues the copies this needs and the
allocator hands them over with its own (`BlockCopies.tier_*`), so the executor
runs them before the step's forward, like a swap-in; the loaded block is then
an ordinary cached prefix block. A block is named by `block_key`, a digest of
the whole prefix up to and including it, stable across processes, so a disk
tier written by one server serves the next. Torch-free: allocators import it.
"""

from __future__ import annotations

import abc
import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Protocol

from servelab.step.plan import BlockCopies

KEY_BYTES = 16
# where a disk-backed tier keeps its blocks unless told (the run option kv_tier_folder):
# beside the kernel cache, one folder per user
DEFAULT_FOLDER = "~/.cache/servelab/kv_blocks"


def block_key(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    """The key of a full block of `tokens` whose prefix before it has key `parent`
    (None: the first block). A chain digest, like the paged cache's chain hash, but
    the same in every process (Python's `hash` of a tuple is not promised to be)."""
    digest = hashlib.blake2b(parent or b"", digest_size=KEY_BYTES)
    digest.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return digest.digest()


class HostBlocks(Protocol):
    """The host pool's blocks (the swap space, `engine.swap_space`) as the allocator
    lends them to its tier: one budget for swapped-out sequences and the tier, so
    host memory never exceeds it. Swap comes first: when a swap-out needs blocks the
    tier holds, the allocator takes them back (`KVTier.reclaim_host_blocks`)."""

    num_blocks: int  # the whole pool, swap and tier together

    def take(self) -> int | None:
        """A free host block for the tier, or None when none is free."""
        ...

    def give(self, block: int) -> None:
        """Returns a host block the tier no longer holds to the pool."""
        ...


@dataclass
class TierFigures:
    """The counts every tier keeps (cumulative): the engine records them per step."""

    hits: int = 0  # blocks a lookup found below the device cache and loaded
    misses: int = 0  # blocks a lookup missed on the device and below it: computed
    hit_tokens: int = 0  # tokens loaded instead of prefilled again
    blocks_stored: int = 0  # blocks copied into the tier
    blocks_dropped: int = 0  # blocks offered but not kept (no room, or a failed write)
    blocks_evicted: int = 0  # blocks the tier let go to make room
    load_failures: int = 0  # entries found damaged on load (recomputed, with a warning)
    bytes_loaded: int = 0
    bytes_stored: int = 0
    read_seconds: float = 0.0  # time the tier spent reading its storage on loads

    def hit(self, tokens: int, nbytes: int) -> None:
        """One block found below the device cache and queued to load."""
        self.hits += 1
        self.hit_tokens += tokens
        self.bytes_loaded += nbytes

    def as_dict(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class KVTier(abc.ABC):
    """Keeps copies of prefix blocks the device cache lets go, below it.

    Rules:
    - `holds(key)` is a pure query; `load(key, tokens, block)` queues the copy of
      the block kept under `key` into device block `block` and returns True, or
      returns False (nothing queued) when it cannot: the block is then computed;
    - a tier never loads a block for another prefix: an entry is found by its key
      (the whole prefix's digest) and its tokens must equal `tokens`; storage it
      cannot trust (a damaged or foreign file) is never read as K/V;
    - `store(key, tokens, block)` keeps a copy of device block `block` (a copy
      queued) or drops it; called for a block it holds already, it only records
      the use;
    - a queued load gets what its entry held when it was queued, whatever the tier
      does with the entry before `take_copies` hands the load over (`host` keeps
      such an entry until then; `disk` reads and stages the K/V at `load`);
    - host blocks come only from the `HostBlocks` given to `bind`, and go back
      through it or `reclaim_host_blocks`;
    - `check_integrity()` raises AssertionError on any broken invariant.

    `write_through`: False (write-back) has the allocator offer a block when it
    evicts it; True when it completes one (every full block once).

    Engine-supplied context: `block_bytes` (one block's K/V over every layer),
    `kv_identity` (the model, its KV shape, dtype and block size: what must match
    for kept K/V to be reused) and `payloads` (False: the executor keeps no K/V
    tensors, e.g. a simulated one; only the bookkeeping runs).
    """

    description: ClassVar[str] = ""
    keeps_blocks: ClassVar[bool] = True  # False: no tier (`none`); the engine attaches nothing
    write_through: bool = False

    def __init__(self, block_bytes: int, kv_identity: dict[str, Any], payloads: bool) -> None:
        self.block_bytes = block_bytes
        self.kv_identity = dict(kv_identity)
        self.block_size = int(self.kv_identity.get("block_size", 1))
        self.payloads = payloads
        self.figures = TierFigures()
        self.host: HostBlocks | None = None

    def bind(self, host: HostBlocks | None) -> None:
        """Called once by the allocator the tier is attached to: the host blocks it
        may borrow (None: the allocator has no host pool)."""
        self.host = host

    # -- the lookup below the device cache
    @abc.abstractmethod
    def holds(self, key: bytes) -> bool:
        """Whether a block is kept under `key` and can be loaded now. Pure."""

    @abc.abstractmethod
    def load(self, key: bytes, tokens: tuple[int, ...], block: int) -> bool:
        """Queues the copy of the block kept under `key` into device block `block`;
        False when it cannot (nothing queued: the block is computed instead)."""

    def missed(self, num_blocks: int) -> None:
        """A lookup had `num_blocks` blocks to compute, found neither on the device nor here."""
        self.figures.misses += num_blocks

    # -- what the device cache lets go
    @abc.abstractmethod
    def store(self, key: bytes, tokens: tuple[int, ...], block: int) -> None:
        """A full prefix block, in device block `block` until this step's copies
        ran: keep a copy (queue it) or drop it."""

    # -- the host pool, shared with swap
    def host_blocks_held(self) -> list[int]:
        """The host blocks the tier holds now."""
        return []

    def reclaimable_host_blocks(self) -> int:
        """How many of its host blocks the tier could give back now."""
        return 0

    def reclaim_host_blocks(self, num_blocks: int) -> int:
        """Gives back up to `num_blocks` host blocks (dropping those entries) for a
        swap-out; returns how many."""
        return 0

    # -- copies and figures
    @abc.abstractmethod
    def take_copies(self) -> BlockCopies:
        """Returns and clears the copies queued since the last call (the allocator
        hands them over with its own); this step's loads no longer pin their entries."""

    def stats(self) -> dict[str, float]:
        """`TierFigures` and any figure of the tier's own (blocks held, ...)."""
        return self.figures.as_dict()

    @abc.abstractmethod
    def check_integrity(self) -> None:
        """Asserts every invariant of the docstring above."""
