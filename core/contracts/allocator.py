"""The KV allocator contract: what a part that owns sequence -> block mapping implements.

Pure CPU bookkeeping (block ids, ref counts, hashes): this module and every
allocator import no torch, so an allocator can be unit-tested and fuzzed alone.
Block copies an allocator needs (swap, copy-on-write) are returned as
`BlockCopies` by `take_copies()` and run by the executor before the forward.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, ClassVar

from servelab.errors import ConfigError
from servelab.step.plan import BlockCopies

if TYPE_CHECKING:
    from servelab.contracts.kv_tier import KVTier
    from servelab.step.sequence import Sequence


class KVAllocator(abc.ABC):
    """Owns the mapping sequence -> physical KV blocks. Pure CPU bookkeeping:
    block ids, ref counts, hashes; no tensors. Copies it needs (swap, COW) are
    returned by `take_copies()` and run by `KVCache.apply` before the forward.

    Rules:
    - a block is either free or referenced; its ref count equals the number of
      block tables (device side) holding it;
    - `allocate(seq, n)` gives `seq` room for its first `n` tokens; the tokens
      a step writes, `[seq.num_computed_tokens, n)`, never land in a block that
      another sequence also references (copy-on-write first);
    - `free(seq)` is idempotent, and after every sequence is freed every block
      is free again;
    - `check_integrity()` raises AssertionError on any broken invariant.

    Engine-supplied context: `token_capacity`, `host_token_capacity` (what the KV
    memory budget and the swap space hold, in tokens) and `max_model_len`; the
    allocator derives its block counts from them.
    """

    description: ClassVar[str] = ""
    block_size: int
    num_blocks: int

    # -- capacity
    @abc.abstractmethod
    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Free blocks `allocate(seq, num_tokens)` would take now (prefix-cache
        hits and copy-on-write included)."""

    def blocks_needed_together(self, requests: list[tuple[Sequence, int]]) -> int:
        """Free blocks allocating every `(seq, num_tokens)` pair would take,
        where the sequences may share blocks (a forked group). The default adds
        the single needs up, an upper bound; an allocator with copy-on-write
        should count a shared block's copies exactly."""
        return sum(self.blocks_needed(seq, n) for seq, n in requests)

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Could `allocate(seq, num_tokens)` succeed now? A shorthand for callers
        outside the scheduler core (which asks `blocks_needed` and `num_free_blocks`
        itself): an allocator changes its answer through `blocks_needed`."""
        return self.blocks_needed(seq, num_tokens) <= self.num_free_blocks

    @abc.abstractmethod
    def allocate(self, seq: Sequence, num_tokens: int) -> int:
        """Room for the first `num_tokens` tokens of `seq`. For a sequence with no
        blocks yet, attaches the cached prefix first and returns how many tokens
        it covers (0 without prefix caching); otherwise returns 0."""

    @abc.abstractmethod
    def free(self, seq: Sequence) -> None:
        """Releases every block `seq` holds (device and host)."""

    @abc.abstractmethod
    def block_table(self, seq: Sequence) -> list[int]:
        """Physical device block ids of `seq`, in logical order."""

    def match_prefix(self, seq: Sequence) -> int:
        """Leading tokens of `seq` whose K/V the prefix cache already holds
        (whole blocks, always leaving at least one token to compute). Pure query;
        `order=lpm` schedulers rank waiting requests by it."""
        return 0

    def commit(self, seq: Sequence) -> bool:
        """Called after a step computed tokens of `seq`: full blocks may now be
        published to the prefix cache. No-op without prefix caching. True when
        it rewrote the sequence's block table (a cache that swaps a sequence's
        private copies of blocks another sequence cached first for the cached
        ones): whoever keeps a copy of the table must read it again."""
        return False

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Speculative decoding's rollback: `seq` keeps K/V for its first
        `num_tokens` tokens only (its `num_computed_tokens`: the drafts the target
        rejected were written past them), so the blocks past those tokens are
        released. A cache only ever holds computed tokens (`commit` publishes by
        `num_computed_tokens`), so no rejected token reaches it. The default
        releases nothing: correct (the slots are written again before they are
        read), but it keeps room the allocator could give others."""

    # -- the decode phase (servelab.scheduling.core.DecodePhase): growing and committing
    # every running sequence at once while they all decode. Batch calls, because `allocate`
    # / `commit` per sequence cost Python work per sequence every step; the defaults are
    # exactly those per-sequence calls, correct for any allocator; an override only makes
    # them cheap.
    def extend_decodes(self, seqs: list[Sequence], rows: list[int]) -> list[int] | None:
        """Room for one more token in each of `seqs`, all decoding (each computes
        its last token), where exactly `seqs[r]` for r in `rows` need a new
        block at the end of their table. Returns those new blocks, in `rows`
        order; or None, changing nothing, when that is not all it takes (blocks
        are short, or a write needs copy-on-write): the scheduler then plans one
        group at a time."""
        pairs = [(seq, seq.num_computed_tokens + 1) for seq in seqs]
        need = self.blocks_needed_together(pairs)
        if need != len(rows) or need > self.num_free_blocks:
            return None
        for row in rows:
            seq = seqs[row]
            self.allocate(seq, seq.num_computed_tokens + 1)
        return [self.block_table(seqs[row])[-1] for row in rows]

    def commit_decodes(
        self, seqs: list[Sequence], written_blocks: list[int], filled_rows: list[int]
    ) -> bool:
        """After a step of decode rows: `seqs[i]` wrote one token into block
        `written_blocks[i]` (its `num_computed_tokens` already counts it); the
        sequences in `filled_rows` filled that block. Same effect as `commit` of
        every sequence; True when a block table was rewritten (see `commit`)."""
        rewritten = False
        for seq in seqs:
            rewritten = self.commit(seq) or rewritten
        return rewritten

    def attach_tier(self, tier: KVTier) -> None:
        """Called once, before the first step, when the engine has a KV tier: the
        prefix blocks this allocator evicts go to `tier` (or, for a write-through
        tier, the blocks it completes), a new sequence's lookup continues there past
        its device match, and the tier's copies leave with `take_copies`
        (`servelab.contracts.kv_tier`). The default refuses: an allocator with no
        prefix cache has nothing to keep below it."""
        raise ConfigError(
            f"allocator {getattr(self, 'name', type(self).__name__)!r} keeps no prefix cache, "
            "so a KV tier has nothing to keep; use allocator=paged with "
            "allocator.prefix_caching=true, or allocator=radix, or kv_tier=none"
        )

    @abc.abstractmethod
    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` shares all of `parent`'s blocks (ref counts +1); a later write
        into a shared block copies it first."""

    # -- swapping (a group of sequences that may share blocks moves together)
    @abc.abstractmethod
    def can_swap_out(self, seqs: list[Sequence]) -> bool:
        """Does the host pool have room for these sequences' blocks?"""

    @abc.abstractmethod
    def swap_out(self, seqs: list[Sequence]) -> None:
        """Moves the sequences' blocks to host blocks (copies queued), frees the device blocks."""

    @abc.abstractmethod
    def can_swap_in(self, seqs: list[Sequence]) -> bool:
        """Are there enough free device blocks to bring these sequences back?"""

    @abc.abstractmethod
    def swap_in(self, seqs: list[Sequence]) -> None:
        """Moves the sequences' host blocks back to fresh device blocks (copies queued)."""

    @abc.abstractmethod
    def take_copies(self) -> BlockCopies:
        """Returns and clears the block copies queued since the last call."""

    # -- figures
    @property
    @abc.abstractmethod
    def num_free_blocks(self) -> int: ...

    @abc.abstractmethod
    def usage(self) -> dict[str, float]:
        """At least: tokens_used, tokens_reserved, tokens_capacity, blocks_free,
        host_blocks_free, prefix_hit_tokens, prefix_query_tokens; `evictions`
        (cached blocks evicted so far) where the allocator has a cache to evict
        from. Every other figure is the allocator's own: the engine records each
        one in its step records and run summary as `kv_<name>` (its value after
        the step), so a plugin's counter reaches the results without the engine
        knowing it."""

    @abc.abstractmethod
    def check_integrity(self) -> None:
        """Asserts every invariant of the docstring above."""
