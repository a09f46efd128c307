"""Batched decode over SDPA: the step's decodes (its first rows, one query each)
padded to their longest context and gathered head-major in one `index_select`
per K and V, then one masked SDPA call for the whole batch. `flash_varlen`'s
`sdpa` impl plans it once per step (`plan_one_query_rows`) and runs it in every
layer (`decode_attention`): one call instead of one per sequence.

`padded_context_slots`, the cache slots of keys padded to a common length
(a padding key repeats its sequence's last one, so it is finite even where
unwritten cache memory is NaN), is the layout the `padded` backend reads too.
`per_request`, the default, does not import this module.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from servelab.plugins.attention.per_request import Workspace, context_slots
from servelab.step.metadata import AttentionMetadata


@dataclass
class OneQueryPlan:
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


def padded_context_slots(
    meta: AttentionMetadata, num_seqs: int, max_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """For batch rows `0..num_seqs`, each padded to `max_len` keys: the cache
    slot of every key, int64 `[num_seqs, max_len]`, and which keys are real,
    bool `[num_seqs, max_len]`. A padding key repeats its sequence's last key:
    finite even where unwritten cache memory is NaN."""
    device = meta.seq_lens.device
    seq_lens = meta.seq_lens[:num_seqs].long().unsqueeze(1)
    positions = torch.arange(max_len, device=device).unsqueeze(0)
    clamped = torch.minimum(positions, seq_lens - 1)
    seqs = torch.arange(num_seqs, device=device).unsqueeze(1)
    slots = context_slots(meta.block_tables, seqs, clamped, meta.block_size)
    return slots, positions < seq_lens


def padded_key_rows(
    meta: AttentionMetadata, num_seqs: int, max_len: int, num_kv_heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`padded_context_slots` as cache rows (`[num_slots * num_kv_heads, head_dim]`
    view) in `[seq, kv_head, key]` order, int64 `[num_seqs * num_kv_heads *
    max_len]`, and which keys are real, bool `[num_seqs, max_len]`."""
    slots, is_real = padded_context_slots(meta, num_seqs, max_len)
    heads = torch.arange(num_kv_heads, device=slots.device).view(1, -1, 1)
    rows = (slots.unsqueeze(1) * num_kv_heads + heads).reshape(-1)
    return rows, is_real


def gather_padded(
    cache: torch.Tensor, rows: torch.Tensor, num_seqs: int, max_len: int, out: torch.Tensor
) -> torch.Tensor:
    """Keys or values at `rows` (see `padded_key_rows`) as `[num_seqs,
    num_kv_heads, max_len, head_dim]`, contiguous, written into `out`."""
    head_dim = cache.shape[-1]
    torch.index_select(cache.view(-1, head_dim), 0, rows, out=out.view(-1, head_dim))
    return out.view(num_seqs, -1, max_len, head_dim)


def plan_one_query_rows(meta: AttentionMetadata, num_kv_heads: int) -> OneQueryPlan | None:
    """The batched-decode plan of `meta`'s leading one-query sequences, None when
    there are none."""
    num = meta.num_one_query_seqs
    if num == 0:
        return None
    lens_cpu = meta.seq_lens_cpu[:num]
    max_len = max(lens_cpu)
    rows, is_real = padded_key_rows(meta, num, max_len, num_kv_heads)
    padded = min(lens_cpu) != max_len
    mask = is_real.view(num, 1, 1, max_len) if padded else None
    return OneQueryPlan(num, max_len, num_kv_heads, rows, mask)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: OneQueryPlan,
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
