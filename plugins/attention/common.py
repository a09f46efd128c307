"""What the torch attention backends share: writing this step's K/V into the
paged cache, finding a sequence's context in it, GQA head expansion and the
causal rule for a chunk that starts mid-context.

Cache layout (one layer): `k_cache`, `v_cache`, each
`[num_blocks, block_size, num_kv_heads, head_dim]`. Token position `p` of a
sequence lives in *slot* `block_table[p // block_size] * block_size + p %
block_size` of the flat view `[num_blocks * block_size, num_kv_heads, head_dim]`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from servelab.batch import AttentionMetadata


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


# SDPA reads grouped K/V heads itself (`enable_gqa`, no repeated copy) from torch 2.5 on
SDPA_HAS_GQA = _torch_version() >= (2, 5)


def flat_cache(cache: torch.Tensor) -> torch.Tensor:
    """The cache as `[num_slots, num_kv_heads, head_dim]`, sharing its memory.
    Fails loudly (`view`) when the cache tensor is not contiguous."""
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    return cache.view(num_blocks * block_size, num_kv_heads, head_dim)


# -- writing


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Writes `k`, `v` (`[num_tokens, num_kv_heads, head_dim]`) into the cache at
    `slot_mapping` (int64 `[num_tokens]`), in place.

    Every slot must be a valid slot (`0 <= slot < num_blocks * block_size`):
    the engine never pads a batch, so there are no `-1` padding slots to skip,
    and skipping them would cost a mask (or a host sync) in every layer.
    """
    flat_cache(k_cache).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    flat_cache(v_cache).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


# -- finding a context in the cache


def context_slots(
    block_tables: torch.Tensor,
    seq_ids: torch.Tensor,
    positions: torch.Tensor,
    block_size: int,
) -> torch.Tensor:
    """Flat slot (int64) of token `positions` of sequences `seq_ids` (same shape,
    broadcastable): the block table row picks the physical block, the position
    modulo `block_size` the offset inside it."""
    blocks = block_tables[seq_ids, torch.div(positions, block_size, rounding_mode="floor")]
    return blocks.long() * block_size + positions % block_size


def packed_context_slots(meta: AttentionMetadata) -> torch.Tensor:
    """Slots of every sequence's whole context, packed like the keys of a varlen
    kernel: sequence i owns entries `seq_start_loc[i]:seq_start_loc[i+1]`.
    Built on the metadata's device without a host sync."""
    return packed_slots_of(meta, list(range(meta.num_seqs)))


def packed_slots_of(meta: AttentionMetadata, seqs: list[int]) -> torch.Tensor:
    """Slots of the whole contexts of batch rows `seqs`, packed in that order."""
    device = meta.seq_lens.device
    seq_lens_cpu = meta.seq_lens_cpu
    num_keys = sum(seq_lens_cpu[i] for i in seqs)
    ids = torch.tensor(seqs, dtype=torch.long, device=device)
    lens = meta.seq_lens.long()[ids]
    seq_ids = torch.repeat_interleave(ids, lens, output_size=num_keys)
    starts = torch.cumsum(lens, 0) - lens  # where each sequence's keys begin, packed
    positions = torch.arange(num_keys, device=device) - torch.repeat_interleave(
        starts, lens, output_size=num_keys
    )
    return context_slots(meta.block_tables, seq_ids, positions, meta.block_size)


def gather_slots(
    cache: torch.Tensor, slots: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """`cache` rows at `slots`: `[len(slots), num_kv_heads, head_dim]`. An
    `index_select`, several times faster on the CPU than advanced indexing, into
    `out` when given (a reused buffer spares the allocator a large block every layer)."""
    flat = flat_cache(cache)
    if out is None:
        return flat.index_select(0, slots)
    return torch.index_select(flat, 0, slots, out=out.view(len(slots), *flat.shape[1:]))


def gather_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table_row: torch.Tensor,
    seq_len: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's first `seq_len` keys and values, contiguous
    (`[seq_len, num_kv_heads, head_dim]` each), read through its block table row
    (a 1-D int tensor on the cache's device)."""
    block_size = k_cache.shape[1]
    positions = torch.arange(seq_len, device=k_cache.device)
    slots = context_slots(block_table_row.unsqueeze(0), 0, positions, block_size)
    return gather_slots(k_cache, slots), gather_slots(v_cache, slots)


# -- heads and masks


def expand_kv_heads(x: torch.Tensor, num_queries_per_kv: int, dim: int) -> torch.Tensor:
    """Grouped-query attention: repeats each KV head `num_queries_per_kv` times
    along `dim`, so query head `h` meets KV head `h // num_queries_per_kv`."""
    if num_queries_per_kv == 1:
        return x
    return x.repeat_interleave(num_queries_per_kv, dim=dim)


def causal_offset_mask(context_len: int, query_len: int, device: torch.device) -> torch.Tensor:
    """Boolean `[query_len, context_len + query_len]`, True where attention is
    allowed: query j sits at position `context_len + j` and sees keys
    `0 .. context_len + j` (the causal diagonal aligned bottom-right)."""
    query_pos = torch.arange(query_len, device=device).unsqueeze(1) + context_len
    key_pos = torch.arange(context_len + query_len, device=device).unsqueeze(0)
    return key_pos <= query_pos


def sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
) -> torch.Tensor:
    """SDPA over 4-D `[batch, heads, len, dim]` inputs (the layout the CPU flash
    kernel takes; 3-D inputs fall back to the slower math kernel) with K/V heads
    grouped: query head h reads KV head `h // (q_heads // kv_heads)`."""
    group = q.shape[1] // k.shape[1]
    if group == 1:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale
        )
    if SDPA_HAS_GQA:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale, enable_gqa=True
        )
    k, v = expand_kv_heads(k, group, dim=1), expand_kv_heads(v, group, dim=1)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale
    )


# -- scratch memory


class Workspace:
    """Scratch buffers kept across layers and steps, grown on demand.

    A layer's gathered K/V are tens of megabytes; allocating them afresh every
    layer costs more than the gather itself on the CPU (the allocator maps and
    faults in fresh pages each time). A buffer handed out by `take` is valid
    until the next `take` of the same name: use it within one backend call.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def take(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        numel = 1
        for size in shape:
            numel *= size
        buffer = self._buffers.get(name)
        if (
            buffer is None
            or buffer.numel() < numel
            or buffer.dtype != dtype
            or buffer.device != device
        ):
            # a little headroom: contexts grow by one token a step
            buffer = torch.empty(numel + numel // 8, dtype=dtype, device=device)
            self._buffers[name] = buffer
        return buffer[:numel].view(shape)


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
