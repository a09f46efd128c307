"""The two SDPA strategies the torch backends build on, each planned once per
step and run by every layer:

- batched decode (`plan_decode_batch`, `decode_attention`): the step's
  decodes padded to their longest context, gathered head-major in one
  `index_select` per K and V, one masked SDPA call;
- one call per sequence (`plan_per_seq`, `per_seq_attention`): a fresh
  prompt attends over this step's own K/V (no cache read), every other
  sequence over its context gathered from the cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from servelab.batch import AttentionMetadata
from servelab.plugins.attention.common import (
    Workspace,
    causal_offset_mask,
    context_slots,
    gather_slots,
    packed_slots_of,
    sdpa,
)

# -- batched decode


@dataclass
class DecodeBatchPlan:
    """The decode part of a step (its first `num_seqs` sequences, one query
    each) padded to its longest context, built once per step.

    `rows` indexes the cache viewed as `[num_slots * num_kv_heads, head_dim]`
    in `[seq, kv_head, key]` order, so one `index_select` lays the keys out
    exactly as SDPA reads them. A padding key (past a sequence's length)
    repeats that sequence's last key: a finite value even where unwritten cache
    memory is NaN; the mask hides it.
    """

    num_seqs: int
    max_len: int
    num_kv_heads: int
    rows: torch.Tensor  # int64 [num_seqs * num_kv_heads * max_len]
    attn_mask: torch.Tensor | None  # bool [num_seqs, 1, 1, max_len], None when nothing pads


def padded_key_rows(
    meta: AttentionMetadata, num_seqs: int, max_len: int, num_kv_heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """For batch rows `0..num_seqs`, each padded to `max_len` keys: the cache
    rows (`[num_slots * num_kv_heads, head_dim]` view) in `[seq, kv_head, key]`
    order, int64 `[num_seqs * num_kv_heads * max_len]`, and which keys are
    real, bool `[num_seqs, max_len]`. A padding key repeats its sequence's last
    key: finite even where unwritten cache memory is NaN."""
    device = meta.seq_lens.device
    seq_lens = meta.seq_lens[:num_seqs].long().unsqueeze(1)
    positions = torch.arange(max_len, device=device).unsqueeze(0)
    clamped = torch.minimum(positions, seq_lens - 1)
    seqs = torch.arange(num_seqs, device=device).unsqueeze(1)
    slots = context_slots(meta.block_tables, seqs, clamped, meta.block_size)
    heads = torch.arange(num_kv_heads, device=device).view(1, -1, 1)
    rows = (slots.unsqueeze(1) * num_kv_heads + heads).reshape(-1)
    return rows, positions < seq_lens


def gather_padded(
    cache: torch.Tensor, rows: torch.Tensor, num_seqs: int, max_len: int, out: torch.Tensor
) -> torch.Tensor:
    """Keys or values at `rows` (see `padded_key_rows`) as `[num_seqs,
    num_kv_heads, max_len, head_dim]`, contiguous, written into `out`."""
    head_dim = cache.shape[-1]
    torch.index_select(cache.view(-1, head_dim), 0, rows, out=out.view(-1, head_dim))
    return out.view(num_seqs, -1, max_len, head_dim)


def plan_decode_batch(meta: AttentionMetadata, num_kv_heads: int) -> DecodeBatchPlan | None:
    """The batched-decode plan of `meta`'s decodes, None when there are none."""
    num = meta.num_decodes
    if num == 0:
        return None
    lens_cpu = meta.seq_lens_cpu[:num]
    max_len = max(lens_cpu)
    rows, is_real = padded_key_rows(meta, num, max_len, num_kv_heads)
    padded = min(lens_cpu) != max_len
    mask = is_real.view(num, 1, 1, max_len) if padded else None
    return DecodeBatchPlan(num, max_len, num_kv_heads, rows, mask)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: DecodeBatchPlan,
    scale: float,
    workspace: Workspace,
) -> torch.Tensor:
    """Attention of one query per sequence over its whole context, for the
    whole decode batch in one SDPA call: `q` `[num_seqs, num_heads, head_dim]`
    -> `[num_seqs, num_heads, head_dim]`.

    Grouped-query heads need no copy: the `group` query heads of one KV head
    become `group` query rows of that head (each row sees every real key)."""
    num, length, kv_heads = plan.num_seqs, plan.max_len, plan.num_kv_heads
    num_heads, head_dim = q.shape[1], q.shape[2]
    shape = (num, kv_heads, length, head_dim)
    keys = gather_padded(
        k_cache, plan.rows, num, length, workspace.take("k", shape, k_cache.dtype, k_cache.device)
    )
    values = gather_padded(
        v_cache, plan.rows, num, length, workspace.take("v", shape, v_cache.dtype, v_cache.device)
    )
    out = F.scaled_dot_product_attention(
        q.reshape(num, kv_heads, num_heads // kv_heads, head_dim),
        keys,
        values,
        attn_mask=plan.attn_mask,
        scale=scale,
    )
    return out.reshape(num, num_heads, head_dim)


# -- one SDPA call per sequence


@dataclass
class SeqAttention:
    """One sequence's SDPA call. Its queries are `q[query_start:query_end]`;
    its keys are this step's own K/V at the same rows when the sequence starts
    at position 0 (`from_cache` False: a fresh prompt needs no cache read), else
    `[key_start:key_end]` of the contexts gathered from the cache."""

    query_start: int
    query_end: int
    key_start: int
    key_end: int
    from_cache: bool
    attn_mask: torch.Tensor | None  # bool [query_len, seq_len]: a chunk after cached context
    is_causal: bool  # a whole prompt from position 0: SDPA's own (square) causal mask


@dataclass
class PerSeqPlan:
    """Per-sequence calls for batch rows `first..num_seqs`, and the packed cache
    slots of the contexts those calls read (None when every one is fresh)."""

    slot_mapping: torch.Tensor  # int64 [num_tokens]: where this step's K/V go
    seqs: list[SeqAttention]
    context_slots: torch.Tensor | None  # int64: packed slots of the cached contexts read


def plan_per_seq(meta: AttentionMetadata, first: int = 0) -> PerSeqPlan:
    """Plans one SDPA call for each of the batch rows `first..` of `meta`."""
    device = meta.slot_mapping.device
    seqs: list[SeqAttention] = []
    cached: list[int] = []
    query_start = sum(meta.query_lens_cpu[:first])
    key_start = 0
    for i in range(first, meta.num_seqs):
        query_len, seq_len = meta.query_lens_cpu[i], meta.seq_lens_cpu[i]
        context_len = seq_len - query_len
        from_cache = context_len > 0
        # SDPA's is_causal aligns the diagonal top-left, which is only right when
        # queries and keys start together; a chunk after cached context needs the
        # offset mask. A single query sees every key: no mask.
        needs_mask = from_cache and query_len > 1
        seqs.append(
            SeqAttention(
                query_start=query_start,
                query_end=query_start + query_len,
                key_start=key_start,
                key_end=key_start + seq_len if from_cache else key_start,
                from_cache=from_cache,
                attn_mask=causal_offset_mask(context_len, query_len, device)
                if needs_mask
                else None,
                is_causal=not from_cache and query_len > 1,
            )
        )
        if from_cache:
            cached.append(i)
            key_start += seq_len
        query_start += query_len
    slots = packed_slots_of(meta, cached) if cached else None
    return PerSeqPlan(meta.slot_mapping, seqs, slots)


def per_seq_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: PerSeqPlan,
    scale: float,
    out: torch.Tensor,
    workspace: Workspace,
) -> torch.Tensor:
    """Runs `plan`'s calls, writing each sequence's rows of `out`
    (`[num_tokens, num_heads, head_dim]`); this step's K/V must be stored already."""
    keys = values = None
    if plan.context_slots is not None:
        shape = (len(plan.context_slots), k_cache.shape[2], k_cache.shape[3])
        keys = gather_slots(
            k_cache,
            plan.context_slots,
            workspace.take("seq_k", shape, k_cache.dtype, k_cache.device),
        )
        values = gather_slots(
            v_cache,
            plan.context_slots,
            workspace.take("seq_v", shape, v_cache.dtype, v_cache.device),
        )
    num_heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[2]
    for s in plan.seqs:
        if s.from_cache:
            seq_k, seq_v = keys[s.key_start : s.key_end], values[s.key_start : s.key_end]
        else:
            seq_k = k[s.query_start : s.query_end].to(k_cache.dtype)
            seq_v = v[s.query_start : s.query_end].to(v_cache.dtype)
        seq_k = seq_k.transpose(0, 1).unsqueeze(0)  # [1, kv_heads, keys, dim]
        seq_v = seq_v.transpose(0, 1).unsqueeze(0)
        seq_q = q[s.query_start : s.query_end]
        if s.query_end - s.query_start == 1:
            # one query: the group of query heads of a KV head become its query rows
            seq_q = seq_q.view(1, kv_heads, num_heads // kv_heads, head_dim)
            seq_out = sdpa(seq_q, seq_k, seq_v, scale)
            out[s.query_start] = seq_out.view(num_heads, head_dim)
        else:
            seq_out = sdpa(
                seq_q.transpose(0, 1).unsqueeze(0),
                seq_k,
                seq_v,
                scale,
                attn_mask=s.attn_mask,
                is_causal=s.is_causal,
            )
            out[s.query_start : s.query_end] = seq_out[0].transpose(0, 1)
    return out
