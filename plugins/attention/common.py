"""What the torch attention backends share: writing this step's K/V into the
paged cache, finding a sequence's context in it, GQA head expansion, the
causal rule for a chunk that starts mid-context, SDPA over grouped heads and
scratch buffers reused across layers (the strategies built on these are in
`sdpa_paths`).

Cache layout (one layer): `k_cache`, `v_cache`, each
`[num_blocks, block_size, num_kv_heads, head_dim]`. Token position `p` of a
sequence lives in *slot* `block_table[p // block_size] * block_size + p %
block_size` of the flat view `[num_blocks * block_size, num_kv_heads, head_dim]`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from servelab.step.metadata import AttentionMetadata


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
