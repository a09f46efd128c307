"""What the torch attention backends share: writing this step's K/V into the
paged cache, finding a sequence's context in it, GQA head expansion and the
causal rule for a chunk that starts mid-context.

Cache layout (one layer): `k_cache`, `v_cache`, each
`[num_blocks, block_size, num_kv_heads, head_dim]`. Token position `p` of a
sequence lives in *slot* `block_table[p // block_size] * block_size + p %
block_size` of the flat view `[num_blocks * block_size, num_kv_heads, head_dim]`.
"""

from __future__ import annotations

import torch

from servelab.batch import AttentionMetadata


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
    device = meta.seq_lens.device
    num_keys = sum(meta.seq_lens_cpu)
    seq_ids = torch.repeat_interleave(
        torch.arange(meta.num_seqs, device=device), meta.seq_lens.long(), output_size=num_keys
    )
    positions = torch.arange(num_keys, device=device) - meta.seq_start_loc[:-1].long()[seq_ids]
    return context_slots(meta.block_tables, seq_ids, positions, meta.block_size)


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
    return flat_cache(k_cache)[slots], flat_cache(v_cache)[slots]


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
