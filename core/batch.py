"""What one step runs: the scheduler's `StepPlan`, the allocator's `BlockCopies`
and the step's tensors, `AttentionMetadata`, built once per step.

Batch order is decodes first, then prefill chunks, so a backend splits them
with one index (`num_decodes`, `num_decode_tokens`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from servelab.sequence import Sequence


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
    samples: bool = False

    def __post_init__(self) -> None:
        if self.start < 0:
            self.start = self.seq.num_computed_tokens
        self.samples = self.start + self.num_query_tokens == self.seq.num_tokens

    @property
    def is_decode(self) -> bool:
        return self.num_query_tokens == 1 and self.samples and self.seq.num_output_tokens > 0


@dataclass
class StepPlan:
    """What the scheduler decided for one step."""

    scheduled: list[ScheduledSeq] = field(default_factory=list)  # decodes first, then prefills
    copies: BlockCopies = field(default_factory=BlockCopies)
    preempted: list[Sequence] = field(default_factory=list)  # preempted during this schedule()
    idle_slots: int = 0  # static batching: finished sequences still holding a slot

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def num_decodes(self) -> int:
        return sum(1 for s in self.scheduled if s.is_decode)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_query_tokens for s in self.scheduled)

    def sort_decodes_first(self) -> None:
        self.scheduled.sort(key=lambda s: not s.is_decode)  # stable: keeps order within each part


@dataclass
class AttentionMetadata:
    """The step's attention inputs, built once per step.

    Sequence i owns query tokens `query_start_loc[i]:query_start_loc[i+1]`
    (packed, decodes first). Its context after this step is `seq_lens[i]`
    tokens; the queries are its last `query_lens[i]` positions, so query j of
    sequence i sits at position `context_lens[i] + j` and attends causally to
    key positions `0 .. context_lens[i] + j`. K/V for position p of sequence i
    lives in physical block `block_tables[i, p // block_size]` at offset
    `p % block_size`; this step's new K/V is written at `slot_mapping`.

    The `*_cpu` lists mirror the tensors so CPU-side planning never syncs.
    """

    num_seqs: int
    num_decodes: int  # the first num_decodes sequences have exactly one query token
    num_tokens: int
    block_size: int
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1], cu_seqlens_q
    seq_start_loc: torch.Tensor  # int32 [num_seqs + 1], cu_seqlens_k
    seq_lens: torch.Tensor  # int32 [num_seqs], context after this step
    context_lens: torch.Tensor  # int32 [num_seqs], computed before this step
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks], padded with 0
    slot_mapping: torch.Tensor  # int64 [num_tokens]
    positions: torch.Tensor  # int64 [num_tokens]
    logits_indices: torch.Tensor  # int64 [num_sampled]: last token of each sampling sequence
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    block_tables_cpu: list[list[int]]
    max_query_len: int
    max_seq_len: int

    @property
    def num_decode_tokens(self) -> int:
        return self.num_decodes

    @property
    def context_lens_cpu(self) -> list[int]:
        return [s - q for s, q in zip(self.seq_lens_cpu, self.query_lens_cpu)]

    @classmethod
    def from_lists(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        sample_mask: list[bool] | None = None,
        device: torch.device | str = "cpu",
        num_decodes: int | None = None,
    ) -> AttentionMetadata:
        """Builds every tensor from plain lists (tests and the engine both use this)."""
        num_seqs = len(query_lens)
        if num_decodes is None:
            num_decodes = 0
            for q in query_lens:
                if q != 1:
                    break
                num_decodes += 1
        positions: list[int] = []
        slots: list[int] = []
        for q, s, table in zip(query_lens, seq_lens, block_tables):
            for p in range(s - q, s):
                positions.append(p)
                slots.append(table[p // block_size] * block_size + p % block_size)
        qsl = [0]
        for q in query_lens:
            qsl.append(qsl[-1] + q)
        ssl = [0]
        for s in seq_lens:
            ssl.append(ssl[-1] + s)
        if sample_mask is None:
            sample_mask = [True] * num_seqs
        logits_idx = [qsl[i + 1] - 1 for i in range(num_seqs) if sample_mask[i]]
        width = max((len(t) for t in block_tables), default=0) or 1
        padded = [t + [0] * (width - len(t)) for t in block_tables]
        i32 = dict(dtype=torch.int32)
        i64 = dict(dtype=torch.int64)
        tensors = dict(
            query_start_loc=torch.tensor(qsl, **i32),
            seq_start_loc=torch.tensor(ssl, **i32),
            seq_lens=torch.tensor(seq_lens, **i32),
            context_lens=torch.tensor([s - q for s, q in zip(seq_lens, query_lens)], **i32),
            block_tables=torch.tensor(padded, **i32).reshape(num_seqs, width),
            slot_mapping=torch.tensor(slots, **i64),
            positions=torch.tensor(positions, **i64),
            logits_indices=torch.tensor(logits_idx, **i64),
        )
        device = torch.device(device)
        if device.type != "cpu":
            tensors = {k: v.pin_memory().to(device, non_blocking=True) for k, v in tensors.items()}
        return cls(
            num_seqs=num_seqs,
            num_decodes=num_decodes,
            num_tokens=qsl[-1],
            block_size=block_size,
            query_lens_cpu=list(query_lens),
            seq_lens_cpu=list(seq_lens),
            block_tables_cpu=[list(t) for t in block_tables],
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
            **tensors,
        )
