"""The four contracts. A part is a class implementing one of these ABCs and
registered under a name through a `servelab_register_*` hook.

Every part is constructed as `cls(**options, **context)` where `options` come
from the user's config node (validated against the constructor's keyword
parameters) and `context` holds what the engine supplies (listed per contract).
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from servelab.batch import AttentionMetadata, BlockCopies, StepPlan
from servelab.sequence import Sequence, SequenceGroup


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
        """Could `allocate(seq, num_tokens)` succeed now?"""
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
        (whole blocks, always leaving at least one token to compute). Pure query."""
        return 0

    def commit(self, seq: Sequence) -> None:
        """Called after a step computed tokens of `seq`: full blocks may now be
        published to the prefix cache. No-op without prefix caching."""

    # -- the decode fast path (servelab.decode_batch); the defaults are correct
    # for any allocator, an override only makes them cheap
    def extend_decodes(self, seqs: list[Sequence], rows: list[int]) -> list[int] | None:
        """Room for one more token in each of `seqs`, all decoding (each computes
        its last token), where exactly `seqs[r]` for r in `rows` need a new
        block at the end of their table. Returns those new blocks, in `rows`
        order; or None, changing nothing, when that is not all it takes (blocks
        are short, or a write needs copy-on-write): the caller then takes the
        general path."""
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
    ) -> None:
        """After a fast decode step: `seqs[i]` wrote one token into block
        `written_blocks[i]` (its `num_computed_tokens` already counts it); the
        sequences in `filled_rows` filled that block. Same effect as `commit` of
        every sequence."""
        for seq in seqs:
            self.commit(seq)

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
        host_blocks_free, prefix_hit_tokens, prefix_query_tokens."""

    @abc.abstractmethod
    def check_integrity(self) -> None:
        """Asserts every invariant of the docstring above."""


class PreemptionPolicy(abc.ABC):
    """Frees room when on-demand allocation runs out.

    Rules: the victim is the lowest priority (largest `priority` value), then
    the latest arrival; a preempted request loses nothing: its final tokens
    equal an unpreempted run. `preempt` returns the status the group goes to
    (WAITING for recompute, SWAPPED for swap).

    Engine-supplied context: none.
    """

    description: ClassVar[str] = ""

    def select_victim(self, running: list[list[Sequence]]) -> list[Sequence]:
        """Chooses the group to preempt among running groups (each a list of sequences)."""
        return max(running, key=lambda g: (g[0].priority, g[0].arrival_time, g[0].seq_id))

    @abc.abstractmethod
    def preempt(self, group: list[Sequence], allocator: KVAllocator) -> str:
        """Frees the group's device blocks; returns "waiting" (recompute) or "swapped"."""

    def resume(self, group: list[Sequence], allocator: KVAllocator) -> bool:
        """Brings a swapped group back if room allows; True when resumed."""
        if not allocator.can_swap_in(group):
            return False
        allocator.swap_in(group)
        return True


class AttentionBackend(abc.ABC):
    """Computes attention for a packed batch of mixed prefill chunks and decodes.

    Rules:
    - `plan(meta)` runs once per step and returns whatever `forward` needs
      (masks, padding indices, kernel arguments); `forward` runs once per layer
      and must not rebuild per-step state;
    - `forward(q, k, v, kv_cache, plan)` first writes this step's `k`, `v`
      (`[num_tokens, num_kv_heads, head_dim]`) into the layer's cache at
      `meta.slot_mapping`, then attends every query (`[num_tokens, num_heads,
      head_dim]`) causally over its sequence's whole context — cached prefix,
      earlier chunks and this chunk — reading K/V through the block table; it
      returns `[num_tokens, num_heads, head_dim]`;
    - the layer cache is a pair `(k_cache, v_cache)`, each
      `[num_blocks, block_size, num_kv_heads, head_dim]`;
    - `check(...)` raises `ConfigError` naming the backend and the part it
      cannot serve.

    Engine-supplied context: `num_heads`, `num_kv_heads`, `head_dim`, `scale`.
    """

    description: ClassVar[str] = ""
    # True when forward() never syncs with the host and skips negative slots,
    # so a decode step can be captured in a CUDA graph (see servelab.cuda_graphs)
    graph_safe: ClassVar[bool] = False

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    def check(self, allocator: KVAllocator, device: torch.device, dtype: torch.dtype) -> None:
        """Raises ConfigError for a combination this backend cannot serve."""

    @abc.abstractmethod
    def plan(self, meta: AttentionMetadata) -> Any:
        """Per-step preparation; the result is passed to every `forward` of the step."""

    @abc.abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        plan: Any,
    ) -> torch.Tensor:
        """Stores k/v into the cache, returns attention output for q."""

    def stats(self) -> dict[str, float]:
        """Backend-specific figures (e.g. padding tokens); cumulative."""
        return {}

    def cpu_paged_kernel_inputs(
        self, plan: Any, num_layers: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Optional: `(slot_mapping, tables, lens)` when, in every one of the
        step's `num_layers` layers, `forward` would be exactly
        `cpu_paged.store_kv` of k/v at `slot_mapping`, then
        `cpu_paged.paged_decode` of q over `tables` and `lens`: the model may
        then run all its layers in one C++ call (`servelab.model.cpu_decoder`)
        instead of calling `forward` per layer. A backend that answers accounts
        those layers as if `forward` had run them. None (the default): the
        model calls `forward`."""
        return None


class Scheduler(abc.ABC):
    """Decides each step's work. See `servelab.scheduler_base.BaseScheduler`."""

    description: ClassVar[str] = ""

    @abc.abstractmethod
    def add(self, group: SequenceGroup) -> None: ...

    @abc.abstractmethod
    def abort(self, request_id: str) -> list[Sequence]: ...

    @abc.abstractmethod
    def schedule(self) -> StepPlan: ...

    @abc.abstractmethod
    def update(
        self, plan: StepPlan, sampled: Mapping[int, list[int]], now: float
    ) -> list[SequenceGroup]:
        """After the forward: `sampled` maps seq_id -> the tokens sampled for it
        (the engine passes a `SampledTokens`, which also lists them in order)."""

    @abc.abstractmethod
    def has_unfinished(self) -> bool: ...


CONTRACTS: dict[str, type] = {
    "scheduler": Scheduler,
    "allocator": KVAllocator,
    "preemption": PreemptionPolicy,
    "attention": AttentionBackend,
}
