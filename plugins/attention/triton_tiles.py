"""Launch parameters of the Triton paged-attention kernels: tile shapes (the
interpreter pays per program and per loop iteration, a GPU per register and byte
of shared memory), tokens per KV-store program, 32- or 64-bit offsets, the scale."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch


def next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@dataclass(frozen=True)
class AttentionTiles:
    """Tile shape of one attention launch. `block_m` counts rows of (query row x
    group head), so it holds `block_m // next_pow2(group)` query rows."""

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2


# GPU tiles: (bytes per element, decode step, head size up to) -> (block_m, block_n,
# num_warps, num_stages), chosen so that every kernel compiles for sm_90 without
# register spills under Triton 3.6 and 3.9 (`benchmarks/triton_registers.py`;
# tests/plugins/test_triton_sm90.py) and decode keeps 4 blocks per SM up to head
# size 128. Decode is bandwidth-bound: occupancy first (16 keys a tile keeps a
# [16, 128] tile's addresses in registers; 32 for 4-byte types at head size <= 64,
# where 16 spilled under 3.6). 4-byte prefill takes 32 x 16 (32 x 32 spilled 1,792
# bytes at head size 128 under 3.6); head size 256 halves the tiles of 4- and
# 8-byte types, and 16-bit types keep 8 warps (4 spill at 255 registers).
GPU_TILES: dict[tuple[int, bool, int], tuple[int, int, int, int]] = {
    (2, True, 256): (16, 16, 4, 2),
    (2, False, 128): (64, 64, 8, 2),
    (2, False, 256): (32, 32, 8, 2),
    (4, True, 64): (16, 32, 4, 1),
    (4, True, 256): (16, 16, 4, 2),
    (4, False, 128): (32, 16, 4, 1),
    (4, False, 256): (16, 16, 4, 1),
    (8, True, 128): (16, 32, 8, 1),
    (8, False, 128): (32, 32, 8, 1),
    (8, True, 256): (16, 16, 8, 1),
    (8, False, 256): (16, 16, 8, 1),
}


def attention_tiles(
    max_query_len: int,
    group_size: int,
    head_dim: int,
    dtype: torch.dtype,
    interpreted: bool,
) -> AttentionTiles:
    """Picks tiles for a step. The interpreter pays per program and per loop
    iteration, not per element, so it gets the largest tiles; a GPU gets the
    `GPU_TILES` entry of the dtype's size, step kind and head size."""
    group_pad = next_power_of_2(group_size)
    rows_needed = next_power_of_2(max(max_query_len, 1) * group_pad)
    if interpreted:
        return AttentionTiles(block_m=max(16, group_pad, min(rows_needed, 128)), block_n=256)
    decode = rows_needed <= 16
    size = min(dtype.itemsize, 8)
    key = next(
        k for k in sorted(GPU_TILES) if k[:2] == (size, decode) and head_dim <= k[2]
    )  # the smallest head-size class that holds head_dim
    block_m, block_n, num_warps, num_stages = GPU_TILES[key]
    return AttentionTiles(max(block_m, group_pad), block_n, num_warps, num_stages)


@functools.lru_cache(maxsize=64)
def float32_scale(value: float) -> float:
    """`value` rounded to float32, on the host, once per distinct value."""
    return float(np.float32(value))


def needs_64bit_offsets(*tensors: torch.Tensor) -> bool:
    """Whether an element offset into one of these tensors (a layer's cache: the
    largest offset is its last element's) may not fit int32. Below 2**31 elements
    every offset the kernels form inside a layer is smaller, so int32 cannot overflow."""
    limit = 2**31 - 1
    return any(
        sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if n > 0) >= limit for t in tensors
    )


def store_tokens_per_program(block_c: int, interpreted: bool) -> int:
    """Tokens one KV-store program copies: 2048 elements a program compiles
    without spills on sm_90 (4096 spilled 56 bytes in bf16 at 8 x 128 columns)."""
    return 64 if interpreted else max(1, min(64, 2048 // block_c))
