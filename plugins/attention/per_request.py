"""`per_request`: the linear layers run batched, attention runs one SDPA call
per sequence over exactly its own context. No padding, but one kernel launch
per sequence per layer: the cost grows with the batch size, not its shape.

`plan`, once per step, decides what each call reads: a fresh prompt this step's
own K/V, every other sequence its context gathered from the cache (one
`index_select` per layer for the batch). `forward`, per layer, is the calls.
The default backend is this one module, so a request enters no other attention
module; the other torch backends import the cache helpers and calls from here.

Cache layout (one layer): `k_cache`, `v_cache`, each `[num_blocks, block_size,
num_kv_heads, head_dim]`; position `p` of a sequence lives in slot
`block_table[p // block_size] * block_size + p % block_size` of the flat view.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F

from servelab.contracts.attention import AttentionBackend
from servelab.contracts.hookspecs import hookimpl
from servelab.step.metadata import AttentionMetadata


class PerRequestBackend(AttentionBackend):
    """One SDPA call per sequence over its own context."""

    name: ClassVar[str] = "per_request"
    description: ClassVar[str] = "one SDPA call per sequence over its own gathered context"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        self.workspace = Workspace()

    def plan(self, meta: AttentionMetadata) -> PerSeqPlan:
        return plan_per_seq(meta)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        plan: PerSeqPlan,
    ) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        store_kv(k, v, k_cache, v_cache, plan.slot_mapping)
        # out=None: a step of one-query rows only returns their outputs as they come
        return per_seq_attention(q, k, v, k_cache, v_cache, plan, self.scale, None, self.workspace)


# -- the plan, once per step


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
    slots of the contexts they read (None when every one is fresh).

    The leading rows that are one query over a cached context (`num_one_query_seqs`
    from packed query row `one_query_start`) are plain ints, not `SeqAttention`s:
    per-call Python overhead, not the attention, is what such a row costs on a
    small model. Their keys are the first packed contexts, so one split by
    `key_splits` (each row's length, then the rest) hands every row its keys.
    `seqs` plans the other rows."""

    slot_mapping: torch.Tensor  # int64 [num_tokens]: where this step's K/V go
    seqs: list[SeqAttention]
    context_slots: torch.Tensor | None  # int64: packed slots of the cached contexts read
    num_one_query_seqs: int = 0
    one_query_start: int = 0
    key_splits: list[int] = field(default_factory=list)  # num_one_query_seqs + 1 sizes


def plan_per_seq(meta: AttentionMetadata, first: int = 0) -> PerSeqPlan:
    """Plans one SDPA call for each of the batch rows `first..` of `meta`."""
    num_one_query = count_leading_one_query(meta, first)
    one_query_end = first + num_one_query
    one_query_lens = meta.seq_lens_cpu[first:one_query_end]
    one_query_keys = sum(one_query_lens)
    query_start = sum(meta.query_lens_cpu[:first])
    seqs, cached, num_keys = plan_seq_calls(
        meta, one_query_end, query_start + num_one_query, one_query_keys
    )
    cached = list(range(first, one_query_end)) + cached
    slots = packed_slots_of(meta, cached) if cached else None
    return PerSeqPlan(
        slot_mapping=meta.slot_mapping,
        seqs=seqs,
        context_slots=slots,
        num_one_query_seqs=num_one_query,
        one_query_start=query_start,
        key_splits=one_query_lens + [num_keys - one_query_keys],
    )


def count_leading_one_query(meta: AttentionMetadata, first: int) -> int:
    """How many rows from `first` on are one query over a cached context. A
    one-token prompt (nothing cached) ends the run: it reads its own K/V."""
    query_lens, seq_lens = meta.query_lens_cpu, meta.seq_lens_cpu
    count = 0
    for i in range(first, meta.num_seqs):
        if query_lens[i] != 1 or seq_lens[i] == 1:
            break
        count += 1
    return count


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


def causal_offset_mask(context_len: int, query_len: int, device: torch.device) -> torch.Tensor:
    """Boolean `[query_len, context_len + query_len]`, True where attention is
    allowed: query j sits at position `context_len + j` and sees keys
    `0 .. context_len + j` (the causal diagonal aligned bottom-right)."""
    query_pos = torch.arange(query_len, device=device).unsqueeze(1) + context_len
    key_pos = torch.arange(context_len + query_len, device=device).unsqueeze(0)
    return key_pos <= query_pos


# -- the calls, every layer


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
    if out is None and plan.num_one_query_seqs and not plan.seqs:
        return decode_calls(q, keys, values, plan, scale)  # those only: nothing to assemble
    out = torch.empty_like(q) if out is None else out
    if plan.num_one_query_seqs:
        first = plan.one_query_start
        out[first : first + plan.num_one_query_seqs] = decode_calls(q, keys, values, plan, scale)
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
    """One SDPA call per one-query row, over its own context only: their
    outputs, `[num_one_query_seqs, num_heads, head_dim]`. Every per-sequence view
    comes from one `unbind` / `split` for the whole batch and the outputs are
    joined by one `cat`: the loop holds nothing but the calls."""
    num, first = plan.num_one_query_seqs, plan.one_query_start
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


# SDPA reads grouped K/V heads itself (`enable_gqa`, no repeated copy) from torch 2.5 on
SDPA_HAS_GQA = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 5)


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
    if group > 1 and SDPA_HAS_GQA:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale, enable_gqa=True
        )
    if group > 1:
        k, v = expand_kv_heads(k, group, dim=1), expand_kv_heads(v, group, dim=1)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale
    )


def expand_kv_heads(x: torch.Tensor, num_queries_per_kv: int, dim: int) -> torch.Tensor:
    """Grouped-query attention: repeats each KV head `num_queries_per_kv` times
    along `dim`, so query head `h` meets KV head `h // num_queries_per_kv`."""
    if num_queries_per_kv == 1:
        return x
    return x.repeat_interleave(num_queries_per_kv, dim=dim)


# -- the paged cache: writing, finding a context, gathering it


def flat_cache(cache: torch.Tensor) -> torch.Tensor:
    """The cache as `[num_slots, num_kv_heads, head_dim]`, sharing its memory.
    Fails loudly (`view`) when the cache tensor is not contiguous."""
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    return cache.view(num_blocks * block_size, num_kv_heads, head_dim)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Writes `k`, `v` (`[num_tokens, num_kv_heads, head_dim]`) into the cache at
    `slot_mapping` (int64 `[num_tokens]`), in place. Every slot must be valid:
    the engine never pads a batch, and skipping `-1` slots would cost a mask (or
    a host sync) in every layer."""
    flat_cache(k_cache).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    flat_cache(v_cache).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


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


def packed_slots_of(meta: AttentionMetadata, seqs: list[int]) -> torch.Tensor:
    """Slots of the whole contexts of batch rows `seqs`, packed in that order.
    Built on the metadata's device without a host sync."""
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


def gather_slots(cache: torch.Tensor, slots: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`cache` rows at `slots`, `[len(slots), num_kv_heads, head_dim]`, written into
    `out` (a reused buffer spares the allocator a large block every layer). An
    `index_select`: several times faster on the CPU than advanced indexing."""
    flat = flat_cache(cache)
    return torch.index_select(flat, 0, slots, out=out.view(len(slots), *flat.shape[1:]))


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


@hookimpl
def servelab_register_attention_backends() -> dict[str, type[AttentionBackend]]:
    return {PerRequestBackend.name: PerRequestBackend}
