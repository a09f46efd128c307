"""One SDPA call per sequence (`plan_per_seq`, `per_seq_attention`), planned
once per step and run by every layer: a fresh prompt attends over this step's
own K/V (no cache read), every other sequence over its context gathered from
the cache; the decodes' calls are planned as plain ints and fed from one
`split` of the gathered contexts. (Batched decode is in `padded_decode`.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from servelab.plugins.attention.common import (
    Workspace,
    causal_offset_mask,
    gather_slots,
    packed_slots_of,
    sdpa,
)
from servelab.step.metadata import AttentionMetadata

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
    slots of the contexts those calls read (None when every one is fresh).

    The leading rows that are one query over a cached context (the step's
    decodes, `num_decodes` of them from packed query row `decode_query_start`)
    are planned as plain ints, not `SeqAttention`s: their keys are the first
    packed contexts, so one `split` by `key_splits` (each decode's context
    length, then the rest of the packed keys) hands every decode its keys.
    Per-sequence Python and tensor-op overhead, not the attention itself, is
    what a decode call costs on a small model. `seqs` plans the other rows."""

    slot_mapping: torch.Tensor  # int64 [num_tokens]: where this step's K/V go
    seqs: list[SeqAttention]
    context_slots: torch.Tensor | None  # int64: packed slots of the cached contexts read
    num_decodes: int = 0
    decode_query_start: int = 0
    key_splits: list[int] = field(default_factory=list)  # num_decodes + 1 sizes


def count_leading_decodes(meta: AttentionMetadata, first: int) -> int:
    """How many rows from `first` on are one query over a cached context. A
    one-token prompt (nothing cached) ends the run: it reads its own K/V."""
    query_lens, seq_lens = meta.query_lens_cpu, meta.seq_lens_cpu
    count = 0
    for i in range(first, meta.num_seqs):
        if query_lens[i] != 1 or seq_lens[i] == 1:
            break
        count += 1
    return count


def plan_per_seq(meta: AttentionMetadata, first: int = 0) -> PerSeqPlan:
    """Plans one SDPA call for each of the batch rows `first..` of `meta`."""
    num_decodes = count_leading_decodes(meta, first)
    decode_end = first + num_decodes
    decode_lens = meta.seq_lens_cpu[first:decode_end]
    decode_keys = sum(decode_lens)
    query_start = sum(meta.query_lens_cpu[:first])
    seqs, cached, num_keys = plan_seq_calls(
        meta, decode_end, query_start + num_decodes, decode_keys
    )
    cached = list(range(first, decode_end)) + cached
    slots = packed_slots_of(meta, cached) if cached else None
    return PerSeqPlan(
        slot_mapping=meta.slot_mapping,
        seqs=seqs,
        context_slots=slots,
        num_decodes=num_decodes,
        decode_query_start=query_start,
        key_splits=decode_lens + [num_keys - decode_keys],
    )


def plan_seq_calls(
    meta: AttentionMetadata, first: int, query_start: int, key_start: int
) -> tuple[list[SeqAttention], list[int], int]:
    """One `SeqAttention` for each of the batch rows `first..`, whose queries
    start at packed row `query_start` and whose cached contexts are packed from
    `key_start` on: the calls, the rows read from the cache, and where the
    packed keys end."""
    device = meta.slot_mapping.device
    seqs: list[SeqAttention] = []
    cached: list[int] = []
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
    return seqs, cached, key_start


def per_seq_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: PerSeqPlan,
    scale: float,
    out: torch.Tensor | None,
    workspace: Workspace,
) -> torch.Tensor:
    """Runs `plan`'s calls, writing each sequence's rows of `out`
    (`[num_tokens, num_heads, head_dim]`; None: a new tensor, for a plan of
    every row) and returns it; this step's K/V must be stored already."""
    keys, values = gather_contexts(k_cache, v_cache, plan, workspace)
    if out is None and plan.num_decodes and not plan.seqs:
        return decode_calls(q, keys, values, plan, scale)  # decodes only: nothing to assemble
    out = torch.empty_like(q) if out is None else out
    if plan.num_decodes:
        first = plan.decode_query_start
        out[first : first + plan.num_decodes] = decode_calls(q, keys, values, plan, scale)
    if plan.seqs:
        # a fresh prompt reads this step's own K/V, in the cache's dtype like cached
        # ones: converted once per layer (a no-op when the dtypes agree), not per prompt
        k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
        seq_calls(q, k, v, keys, values, plan.seqs, scale, out)
    return out


def gather_contexts(
    k_cache: torch.Tensor, v_cache: torch.Tensor, plan: PerSeqPlan, workspace: Workspace
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The packed cached contexts `plan` reads, keys and values each
    `[1, kv_heads, keys, dim]` as SDPA reads them, so a sequence's keys are one
    slice; None, None when every call is fresh."""
    if plan.context_slots is None:
        return None, None
    shape = (plan.context_slots.shape[0], k_cache.shape[2], k_cache.shape[3])
    keys = gather_slots(
        k_cache, plan.context_slots, workspace.take("seq_k", shape, k_cache.dtype, k_cache.device)
    )
    values = gather_slots(
        v_cache, plan.context_slots, workspace.take("seq_v", shape, v_cache.dtype, v_cache.device)
    )
    return keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0)


def decode_calls(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, plan: PerSeqPlan, scale: float
) -> torch.Tensor:
    """One SDPA call per decode, over its own context only: the decodes'
    outputs, `[num_decodes, num_heads, head_dim]`. Every per-sequence view
    comes from one `unbind` / `split` for the whole batch and the outputs are
    joined by one `cat`: the loop holds nothing but the calls."""
    num, first = plan.num_decodes, plan.decode_query_start
    num_heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = keys.shape[1]
    # one query: the group of query heads of a KV head become its query rows, so
    # each call is plain (non-grouped) SDPA: [1, kv_heads, group, dim]
    queries = q[first : first + num].view(num, 1, kv_heads, num_heads // kv_heads, head_dim)
    # split_with_sizes, not split: Tensor.split is a Python wrapper, a few us a call
    seq_keys = keys.split_with_sizes(plan.key_splits, dim=2)
    seq_values = values.split_with_sizes(plan.key_splits, dim=2)
    outs = [
        F.scaled_dot_product_attention(seq_q, seq_k, seq_v, scale=scale)
        for seq_q, seq_k, seq_v in zip(queries.unbind(0), seq_keys, seq_values)
    ]
    return torch.cat(outs).view(num, num_heads, head_dim)


def seq_calls(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    keys: torch.Tensor | None,
    values: torch.Tensor | None,
    seqs: list[SeqAttention],
    scale: float,
    out: torch.Tensor,
) -> None:
    """One SDPA call per planned `SeqAttention` (prompts and chunks), each
    writing its rows of `out`. `keys`, `values`: the packed cached contexts,
    `[1, kv_heads, keys, dim]`; `k`, `v`: this step's K/V in the cache's dtype."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    for s in seqs:
        if s.from_cache:
            seq_k = keys[:, :, s.key_start : s.key_end]
            seq_v = values[:, :, s.key_start : s.key_end]
        else:  # a fresh prompt: this step's own K/V
            seq_k = k[s.query_start : s.query_end].transpose(0, 1).unsqueeze(0)
            seq_v = v[s.query_start : s.query_end].transpose(0, 1).unsqueeze(0)
        seq_q = q[s.query_start : s.query_end]
        kv_heads = seq_k.shape[1]
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
