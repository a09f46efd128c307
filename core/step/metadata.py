"""`AttentionMetadata`: the step's attention inputs as tensors, built once per step.

Batch order is the plan's decodes first (`servelab.step.plan`), then the rest,
so a backend splits off its leading one-query sequences with one index
(`num_one_query_seqs`). Attention knows only that shape: a kernel or call named
for decodes (`paged_decode`, `decode_attention`) is one that attends one query
over a context, whatever the scheduler calls the sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from servelab.step.plan import block_table_array, row_numbers


class Staging(Protocol):
    """What `AttentionMetadata.to_device` needs of a staging buffer (the
    executor's `StepStaging`: pinned host and device buffers, one upload)."""

    def put(self, name: str, values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor: ...

    def upload(self) -> dict[str, torch.Tensor]: ...


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

    The `*_cpu` lists mirror the lengths so CPU-side planning never syncs.
    """

    num_seqs: int
    num_one_query_seqs: int  # the first num_one_query_seqs sequences have one query token each
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
    max_query_len: int
    max_seq_len: int

    @property
    def context_lens_cpu(self) -> list[int]:
        return [s - q for s, q in zip(self.seq_lens_cpu, self.query_lens_cpu)]

    @classmethod
    def from_rows(
        cls,
        starts: np.ndarray,
        counts: np.ndarray,
        tables: np.ndarray,
        block_size: int,
        samples: np.ndarray | None = None,
        device: torch.device | str = "cpu",
        num_one_query_seqs: int | None = None,
        staging: Staging | None = None,
        one_query_slots: np.ndarray | None = None,
        draft_counts: np.ndarray | None = None,
    ) -> AttentionMetadata:
        """The one builder: a step's rows (`servelab.step.plan.StepPlan`) as
        arrays — row i computes positions `[starts[i], starts[i] + counts[i])`
        with block table `tables[i]` (int32, padded) — in a fixed number of numpy
        operations whatever the batch. `samples` masks the rows whose last
        token is sampled (default: all); `num_one_query_seqs` defaults to every
        leading one-query row (the model runner passes its leading decodes, a
        prefix of those). `one_query_slots`: the slot of each of those rows'
        token, when the caller has them (`StepPlan.decode_slots`).
        `draft_counts` (speculative decoding): a sampling row with d drafts
        samples at its last d + 1 positions, so it has d + 1 logits rows.

        Where the tensors live: see `to_device`."""
        num_seqs = len(starts)
        if num_one_query_seqs is None:
            not_one = np.flatnonzero(counts != 1)
            num_one_query_seqs = int(not_one[0]) if not_one.size else num_seqs
        context_lens = starts.astype(np.int32)
        rows, query_start_t, one_query_logits = _aranges(num_seqs)
        logits_t: torch.Tensor | None = one_query_logits
        if num_one_query_seqs == num_seqs:  # one query token per row
            num_tokens = num_seqs
            max_query_len = 1 if num_seqs else 0
            seq_lens = context_lens + 1
            positions = starts
            seq_of_token = rows
        else:
            seq_lens = (starts + counts).astype(np.int32)
            max_query_len = int(counts.max())
            query_start = np.zeros(num_seqs + 1, dtype=np.int64)
            np.cumsum(counts, out=query_start[1:])
            num_tokens = int(query_start[-1])
            seq_of_token = np.repeat(rows, counts)
            positions = np.arange(num_tokens) - (query_start[:-1] - starts)[seq_of_token]
            query_start_t = torch.from_numpy(query_start.astype(np.int32))
            logits_t = None
        if one_query_slots is not None and len(one_query_slots) == num_tokens == num_seqs:
            slots = one_query_slots
        elif num_tokens:
            block_index, offset = np.divmod(positions, block_size)
            slots = tables[seq_of_token, block_index].astype(np.int64) * block_size + offset
        else:
            slots = np.zeros(0, dtype=np.int64)
        if logits_t is None or (samples is not None and not samples.all()):
            logits_idx = np.cumsum(counts) - 1
            if draft_counts is not None:
                logits_idx = _verified_positions(logits_idx, draft_counts, samples)
            elif samples is not None:
                logits_idx = logits_idx[samples]
            logits_t = torch.from_numpy(logits_idx)
        seq_start = np.zeros(num_seqs + 1, dtype=np.int32)
        np.cumsum(seq_lens, out=seq_start[1:])
        tensors = dict(
            query_start_loc=query_start_t,
            seq_start_loc=torch.from_numpy(seq_start),
            seq_lens=torch.from_numpy(seq_lens),
            context_lens=torch.from_numpy(context_lens),
            block_tables=torch.from_numpy(tables),
            slot_mapping=torch.from_numpy(slots),
            positions=torch.from_numpy(positions),
            logits_indices=logits_t,
        )
        if staging is not None or getattr(device, "type", device) != "cpu":
            tensors = cls.to_device(tensors, device, staging)
        return cls(
            num_seqs=num_seqs,
            num_one_query_seqs=num_one_query_seqs,
            num_tokens=num_tokens,
            block_size=block_size,
            query_lens_cpu=[1] * num_seqs if num_tokens == num_seqs else counts.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
            max_query_len=max_query_len,
            max_seq_len=int(seq_lens.max()) if num_seqs else 0,
            **tensors,
        )

    @classmethod
    def from_lists(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        sample_mask: list[bool] | None = None,
        device: torch.device | str = "cpu",
        num_one_query_seqs: int | None = None,
        staging: Staging | None = None,
    ) -> AttentionMetadata:
        """`from_rows` of rows given as lists: query lengths, context lengths
        after the step, block tables (tests write steps this way)."""
        counts = np.asarray(query_lens, dtype=np.int64).reshape(len(query_lens))
        starts = np.asarray(seq_lens, dtype=np.int64).reshape(len(seq_lens)) - counts
        samples = None if sample_mask is None else np.asarray(sample_mask, dtype=bool)
        return cls.from_rows(
            starts, counts, block_table_array(block_tables), block_size, samples, device,
            num_one_query_seqs, staging,
        )  # fmt: skip

    @staticmethod
    def to_device(
        tensors: dict[str, torch.Tensor],
        device: torch.device | str,
        staging: Staging | None = None,
    ) -> dict[str, torch.Tensor]:
        """A step's host tensors where the step runs. With `staging` (begun by the
        caller, who may have put fields of its own first): views of its device
        buffer after one upload of every field, valid until its next `begin`.
        Else on the CPU the tensors themselves, and on another device one pinned
        copy per tensor."""
        if staging is not None:
            for name, tensor in tensors.items():
                staging.put(name, tensor, tensor.dtype)
            views = staging.upload()
            return {name: views[name].view(t.shape) for name, t in tensors.items()}
        if torch.device(device).type == "cpu":
            return tensors
        return {k: v.pin_memory().to(device, non_blocking=True) for k, v in tensors.items()}



def _verified_positions(
    last: np.ndarray, draft_counts: np.ndarray, samples: np.ndarray | None
) -> np.ndarray:
    """The logits rows of a step with drafts: each sampling row's last 1 + d
    positions (`last[i]` its last token's), in row order."""
    per_row = draft_counts + 1
    if samples is not None:
        per_row = np.where(samples, per_row, 0)
    total = int(per_row.sum())
    ends = np.cumsum(per_row)
    within = np.arange(total) - np.repeat(ends - per_row, per_row)  # 0..d in each row
    return np.repeat(last - per_row + 1, per_row) + within


_ARANGES: dict[int, tuple[np.ndarray, torch.Tensor, torch.Tensor]] = {}


def _aranges(n: int) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
    """For a step of n rows of one query each: 0..n-1 (numpy int64: each token's
    row), 0..n (int32 tensor: query starts) and 0..n-1 (int64 tensor: logits
    rows); built once per size, never written."""
    found = _ARANGES.get(n)
    if found is None:
        found = (row_numbers(n), torch.arange(n + 1, dtype=torch.int32), torch.arange(n, dtype=torch.int64))
        _ARANGES[n] = found
    return found
