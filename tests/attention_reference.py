"""A naive attention reference and paged-cache test cases for attention backends.

Independent of the code under test: the reference reads each sequence's
*unpaged* keys and values (the tensors the case was built from, never the
cache) and computes dense softmax attention in float64 with an explicit,
per-query causal loop bound. The paged cache is filled by plain Python loops
over (block, offset), not by any backend helper.

    case = make_paged_case([1, 5], [9, 3], num_heads=4, num_kv_heads=2, block_size=4)
    out = backend.forward(case.q, case.k_new, case.v_new, (case.k_cache, case.v_cache), plan)
    expected = naive_causal_attention(case.q, case.keys, case.values, case.query_lens, case.scale)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from servelab.step.metadata import AttentionMetadata


def naive_causal_attention(
    q: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    query_lens: list[int],
    scale: float,
) -> torch.Tensor:
    """Float64 `[num_tokens, num_heads, head_dim]`.

    `q` is packed (`[num_tokens, num_heads, head_dim]`, sequences in order);
    `keys[i]`/`values[i]` are sequence i's whole context after this step,
    `[seq_len_i, num_kv_heads, head_dim]`. Its queries are its last
    `query_lens[i]` positions: query j sits at `seq_len_i - query_lens[i] + j`
    and attends to keys `0 ..` that position. Query head h reads KV head
    `h // (num_heads // num_kv_heads)`.
    """
    num_heads = q.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    start = 0
    for seq_keys, seq_values, query_len in zip(keys, values, query_lens, strict=True):
        seq_len = seq_keys.shape[0]
        group = num_heads // seq_keys.shape[1]
        context_len = seq_len - query_len
        for j in range(query_len):
            position = context_len + j
            visible = position + 1  # keys 0..position
            for h in range(num_heads):
                query = q[start + j, h].double()
                k_seen = seq_keys[:visible, h // group].double()
                v_seen = seq_values[:visible, h // group].double()
                scores = (k_seen @ query) * scale
                weights = torch.exp(scores - scores.max())
                out[start + j, h] = (weights / weights.sum()) @ v_seen
        start += query_len
    return out


@dataclass
class PagedCase:
    """One step's inputs, its paged cache before the step and the plain truth."""

    q: torch.Tensor  # [num_tokens, num_heads, head_dim], packed in batch order
    k_new: torch.Tensor  # [num_tokens, num_kv_heads, head_dim]: this step's keys
    v_new: torch.Tensor
    keys: list[torch.Tensor]  # per sequence, its whole context after the step, unpaged
    values: list[torch.Tensor]
    k_cache: torch.Tensor  # [num_blocks, block_size, kv_heads, dim]: positions < context_len only
    v_cache: torch.Tensor
    block_tables: list[list[int]]
    block_size: int
    query_lens: list[int]
    seq_lens: list[int]
    scale: float

    @property
    def context_lens(self) -> list[int]:
        return [s - q for s, q in zip(self.seq_lens, self.query_lens, strict=True)]

    def meta(self) -> AttentionMetadata:
        return AttentionMetadata.from_lists(
            self.query_lens, self.seq_lens, self.block_tables, self.block_size
        )

    def expected_caches(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The cache after the step: the step's K/V written at their positions, nothing else touched."""
        k_cache, v_cache = self.k_cache.clone(), self.v_cache.clone()
        for i, (context_len, seq_len) in enumerate(
            zip(self.context_lens, self.seq_lens, strict=True)
        ):
            write_positions(
                k_cache,
                v_cache,
                self.block_tables[i],
                self.keys[i],
                self.values[i],
                context_len,
                seq_len,
            )
        return k_cache, v_cache


def write_positions(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: list[int],
    keys: torch.Tensor,
    values: torch.Tensor,
    start: int,
    end: int,
) -> None:
    """Writes positions `start..end-1` of one sequence by (block, offset), one token at a time."""
    block_size = k_cache.shape[1]
    for p in range(start, end):
        block, offset = block_table[p // block_size], p % block_size
        k_cache[block, offset] = keys[p]
        v_cache[block, offset] = values[p]


def make_paged_case(
    query_lens: list[int],
    context_lens: list[int],
    *,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 8,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    shuffle_blocks: bool = True,
    spare_blocks: int = 3,
    fill: float = float("nan"),
    seed: int = 0,
) -> PagedCase:
    """Random q/K/V for sequences computing `query_lens[i]` tokens after
    `context_lens[i]` cached ones (list decodes first to match engine order).

    Each sequence gets just enough blocks; with `shuffle_blocks` the physical
    ids are a random permutation of the pool (`spare_blocks` extra blocks stay
    unused). The cache holds the context positions; every other slot holds
    `fill` (NaN by default: a backend that reads an unwritten or padding slot
    without masking it shows NaN).
    """
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)

    seq_lens = [c + q for c, q in zip(context_lens, query_lens, strict=True)]
    blocks_needed = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(blocks_needed) + spare_blocks
    pool = (
        torch.randperm(num_blocks, generator=gen).tolist()
        if shuffle_blocks
        else list(range(num_blocks))
    )
    block_tables = []
    for n in blocks_needed:
        block_tables.append(pool[:n])
        pool = pool[n:]

    keys = [randn(s, num_kv_heads, head_dim) for s in seq_lens]
    values = [randn(s, num_kv_heads, head_dim) for s in seq_lens]
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), fill, dtype=dtype)
    v_cache = torch.full_like(k_cache, fill)
    for i, context_len in enumerate(context_lens):
        write_positions(k_cache, v_cache, block_tables[i], keys[i], values[i], 0, context_len)

    q = randn(sum(query_lens), num_heads, head_dim)
    k_new = torch.cat([k[c:] for k, c in zip(keys, context_lens, strict=True)])
    v_new = torch.cat([v[c:] for v, c in zip(values, context_lens, strict=True)])
    return PagedCase(
        q=q,
        k_new=k_new,
        v_new=v_new,
        keys=keys,
        values=values,
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=block_tables,
        block_size=block_size,
        query_lens=list(query_lens),
        seq_lens=seq_lens,
        scale=head_dim**-0.5,
    )
