"""`AttentionMetadata`: the step's attention inputs as tensors, built once per step.

Batch order is the plan's decodes first (`servelab.step.plan`), then the rest,
so a backend splits off its leading one-query sequences with one index
(`num_one_query_seqs`). Attention knows only that shape: a kernel or call named
for decodes (`paged_decode`, `decode_attention`) is one that attends one query
over a context, whatever the scheduler calls the sequence.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch


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

    The `*_cpu` lists mirror the tensors so CPU-side planning never syncs.
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
    block_tables_cpu: list[list[int]]
    max_query_len: int
    max_seq_len: int

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
        num_one_query_seqs: int | None = None,
        staging: Staging | None = None,
    ) -> AttentionMetadata:
        """Builds every tensor from plain lists (tests and the engine both use this)
        with a fixed number of numpy operations: the cost grows with the number of
        sequences only through reading their lists, never through a Python loop
        over tokens. `block_tables` are referenced, not copied: the metadata
        describes the step it was built for. `num_one_query_seqs` defaults to
        every leading one-query sequence (the model runner passes its leading
        decodes, a prefix of those).

        Where the tensors live: see `to_device`."""
        num_seqs = len(query_lens)
        q_lens = np.asarray(query_lens, dtype=np.int64).reshape(num_seqs)
        s_lens = np.asarray(seq_lens, dtype=np.int64).reshape(num_seqs)
        if num_one_query_seqs is None:
            not_one = np.flatnonzero(q_lens != 1)
            num_one_query_seqs = int(not_one[0]) if not_one.size else num_seqs
        qsl = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(q_lens, out=qsl[1:])
        ssl = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(s_lens, out=ssl[1:])
        num_tokens = int(qsl[-1])
        context = s_lens - q_lens
        table_array = block_table_array(block_tables)

        # token t of sequence i sits at position context[i] + (t - qsl[i])
        if num_tokens == num_seqs:  # one query per sequence (decode): no repeat needed
            seq_of_token = np.arange(num_seqs)
            positions = context
        else:
            seq_of_token = np.repeat(np.arange(num_seqs), q_lens)
            positions = np.arange(num_tokens) - (qsl[:-1] - context)[seq_of_token]
        if num_tokens:
            blocks = table_array[seq_of_token, positions // block_size].astype(np.int64)
            slots = blocks * block_size + positions % block_size
        else:
            slots = np.zeros(0, dtype=np.int64)
        if sample_mask is None:
            logits_idx = qsl[1:] - 1
        else:
            logits_idx = (qsl[1:] - 1)[np.asarray(sample_mask, dtype=bool).reshape(num_seqs)]

        tensors = dict(
            query_start_loc=torch.from_numpy(qsl.astype(np.int32)),
            seq_start_loc=torch.from_numpy(ssl.astype(np.int32)),
            seq_lens=torch.from_numpy(s_lens.astype(np.int32)),
            context_lens=torch.from_numpy(context.astype(np.int32)),
            block_tables=torch.from_numpy(table_array),
            slot_mapping=torch.from_numpy(np.ascontiguousarray(slots, dtype=np.int64)),
            positions=torch.from_numpy(np.ascontiguousarray(positions, dtype=np.int64)),
            logits_indices=torch.from_numpy(np.ascontiguousarray(logits_idx, dtype=np.int64)),
        )
        if staging is not None or torch.device(device).type != "cpu":
            tensors = cls.to_device(tensors, device, staging)
        return cls(
            num_seqs=num_seqs,
            num_one_query_seqs=num_one_query_seqs,
            num_tokens=num_tokens,
            block_size=block_size,
            query_lens_cpu=list(query_lens),
            seq_lens_cpu=list(seq_lens),
            block_tables_cpu=block_tables,
            max_query_len=int(q_lens.max()) if num_seqs else 0,
            max_seq_len=int(s_lens.max()) if num_seqs else 0,
            **tensors,
        )

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


def block_table_array(block_tables: list[list[int]]) -> np.ndarray:
    """Ragged block tables as one int32 `[num_seqs, max_blocks]` array, padded
    with 0 (at least one column), in three numpy calls whatever the batch."""
    num_seqs = len(block_tables)
    lens = np.fromiter(map(len, block_tables), dtype=np.int64, count=num_seqs)
    width = int(lens.max()) if num_seqs else 0
    array = np.zeros((num_seqs, max(width, 1)), dtype=np.int32)
    if width:
        total = int(lens.sum())
        flat = np.fromiter(itertools.chain.from_iterable(block_tables), np.int32, count=total)
        # a row-major boolean mask assigns row by row, each row's blocks in order
        array[np.arange(array.shape[1]) < lens[:, None]] = flat
    return array
