"""What one step runs, as the scheduler decided it: `StepPlan` (decodes first,
then prefill chunks), its `ScheduledSeq` items, the allocator's `BlockCopies`,
and after the forward the `SampledTokens`. Torch-free: allocators import it.

A decode is a sequence whose step computes exactly one token past its prompt
(its last token, one it sampled earlier) and samples the next one
(`ScheduledSeq.is_decode`; `Sequence.is_decoding`: its next step would be one).
That is the only meaning of "decode" for the scheduler, the engine and the
metrics: a plan lists its decodes first, the model runner counts them for the
attention split, and a step's `decode_tokens` are its decodes. Every other
token a step computes is prefill work: a prompt chunk, or a recomputing
sequence computing again tokens it sampled before (even one at a time).
Attention sees only shapes: one query token per sequence is a one-query
sequence there (`AttentionMetadata.num_one_query_seqs`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

    from servelab.step.sequence import Sequence


@dataclass
class BlockCopies:
    """Block copies an allocator asks for; `KVCache.apply` runs them, in this order:
    swap-out (device -> host), swap-in (host -> device), copy-on-write (device -> device).
    """

    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)
    copy: list[tuple[int, int]] = field(
        default_factory=list
    )  # (src device block, dst device block)

    def __bool__(self) -> bool:
        return bool(self.swap_out or self.swap_in or self.copy)

    def extend(self, other: BlockCopies) -> None:
        self.swap_out += other.swap_out
        self.swap_in += other.swap_in
        self.copy += other.copy


@dataclass
class ScheduledSeq:
    """One sequence in a step: it computes `num_query_tokens` tokens starting at
    `start` (its `num_computed_tokens` when scheduled); the step samples a token
    for it when that range reaches the end of its tokens."""

    seq: Sequence
    num_query_tokens: int
    start: int = -1
    samples: bool | None = None  # None: derived from the sequence when scheduled

    def __post_init__(self) -> None:
        if self.start < 0:
            self.start = self.seq.num_computed_tokens
        if self.samples is None:
            self.samples = self.start + self.num_query_tokens == self.seq.num_tokens

    @property
    def is_decode(self) -> bool:
        """One token past the prompt, and a sample after it: a decode (module docstring)."""
        return bool(
            self.num_query_tokens == 1 and self.samples and self.start >= self.seq.num_prompt_tokens
        )


class StepPlan:
    """What the scheduler decided for one step.

    A step's sequences are `scheduled`: decodes first, then prefill chunks. In
    a steady decode phase the decodes come as one `DecodeBatch` (`decodes`)
    instead of one `ScheduledSeq` each, so planning a step costs array
    operations, not Python work per sequence; `items` holds the rest. The
    batch changes after the step, so the plan keeps what it was when
    scheduled: its rows' sequences (`decode_seqs`, `decode_seq_ids`) and the
    position each computes (`decode_starts`). Reading `scheduled` lists every
    sequence either way (built once, on first use): the hot path reads
    `decodes` and `items`, everything else may read `scheduled`.
    """

    def __init__(
        self,
        scheduled: list[ScheduledSeq] | None = None,
        copies: BlockCopies | None = None,
        preempted: list[Sequence] | None = None,
        idle_slots: int = 0,
        decodes=None,
        decode_starts: np.ndarray | None = None,
    ) -> None:
        self.items: list[ScheduledSeq] = scheduled if scheduled is not None else []
        self.copies = copies if copies is not None else BlockCopies()
        self.preempted: list[Sequence] = preempted if preempted is not None else []
        self.idle_slots = idle_slots  # static batching: finished sequences still holding a slot
        self.decodes = decodes  # a servelab.step.decode_batch.DecodeBatch, or None
        self.decode_starts = decode_starts  # int64 [rows]: position each batch row computes
        # the batch's row lists when scheduled (the batch replaces, never mutates, them)
        self.decode_seqs: list[Sequence] = decodes.seqs if decodes is not None else []
        self.decode_seq_ids: list[int] = decodes.seq_ids if decodes is not None else []
        self._listed: list[ScheduledSeq] | None = None
        # the most logprob alternatives a live request asked for (-1: none asked);
        # the engine sets it, the executor returns `SampledTokens.logprobs` when >= 0
        self.logprobs_k = -1

    @property
    def num_batch_decodes(self) -> int:
        return 0 if self.decode_starts is None else len(self.decode_starts)

    @property
    def scheduled(self) -> list[ScheduledSeq]:
        if self.decodes is None:
            return self.items
        if self._listed is None:
            assert self.decode_starts is not None  # set with decodes
            starts = self.decode_starts.tolist()
            self._listed = [
                ScheduledSeq(seq, 1, start, True) for seq, start in zip(self.decode_seqs, starts)
            ] + self.items
        return self._listed

    @scheduled.setter
    def scheduled(self, items: list[ScheduledSeq]) -> None:
        self.items, self.decodes, self.decode_starts, self._listed = items, None, None, None
        self.decode_seqs, self.decode_seq_ids = [], []

    def counts(self) -> tuple[int, int, int]:
        """(sequences, decodes, sampled tokens) of this step. A decode computes one
        token, so its decodes are also its decode tokens; every other token is prefill."""
        rows = self.num_batch_decodes
        sampled = rows + sum(1 for i in self.items if i.samples)
        return rows + len(self.items), self.num_decodes, sampled

    @property
    def is_empty(self) -> bool:
        return not self.items and not self.num_batch_decodes

    @property
    def num_decodes(self) -> int:
        return self.num_batch_decodes + sum(1 for s in self.items if s.is_decode)

    @property
    def num_tokens(self) -> int:
        return self.num_batch_decodes + sum(s.num_query_tokens for s in self.items)

    def sort_decodes_first(self) -> None:
        self.items.sort(key=lambda s: not s.is_decode)  # stable: keeps order within each part

    def __repr__(self) -> str:
        return (
            f"StepPlan(batch_decodes={self.num_batch_decodes}, items={len(self.items)}, "
            f"preempted={len(self.preempted)}, idle_slots={self.idle_slots})"
        )


class SampledTokens:
    """The tokens one step sampled: `tokens[i]` belongs to sequence `owners[i]`
    (a prompt that forks now owns n consecutive entries). A plan's decode-batch
    rows come first, one token each, in row order, so `update` reads them by
    position; `get` looks a sequence's tokens up by id (an index built on first
    use). The one type every executor returns and the scheduler and engine read:
    not a mapping, so a plain dict never passes for it."""

    def __init__(self, owners: list[int], tokens: list[int]) -> None:
        self.owners = owners
        self.tokens = tokens
        self.logprobs: list[dict] | None = None  # per entry, when a request asked for them
        # seq_id -> its error, for the sequences whose own sampling raised: their entries
        # are stand-ins, and the engine fails their requests (the others' tokens are exact)
        self.failed: dict[int, Exception] = {}
        self._by_seq: dict[int, list[int]] | None = None

    def get(self, seq_id: int) -> list[int] | None:
        """The tokens sampled for `seq_id` (n for a prompt that forked), None if none."""
        if self._by_seq is None:
            by_seq: dict[int, list[int]] = {}
            for owner, token in zip(self.owners, self.tokens):
                if owner in by_seq:
                    by_seq[owner].append(token)
                else:
                    by_seq[owner] = [token]
            self._by_seq = by_seq
        return self._by_seq.get(seq_id)
