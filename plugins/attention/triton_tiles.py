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


def attention_tiles(
    max_query_len: int,
    group_size: int,
    head_dim: int,
    dtype: torch.dtype,
    interpreted: bool,
) -> AttentionTiles:
    """Picks tiles for a step. The interpreter pays per program and per loop
    iteration, not per element, so it gets the largest tiles; a GPU gets tiles
    that fit registers and shared memory (smaller for 4- and 8-byte types)."""
    group_pad = next_power_of_2(group_size)
    rows_needed = next_power_of_2(max(max_query_len, 1) * group_pad)
    if interpreted:
        return AttentionTiles(block_m=max(16, group_pad, min(rows_needed, 128)), block_n=256)
    wide = dtype.itemsize >= 4 or head_dim > 128
    if rows_needed <= 16 and dtype.itemsize <= 4:
        # Decode: bandwidth-bound, so occupancy first. 16 keys a tile keeps a
        # [16, 128] tile's addresses in registers: sm_90, Qwen3-0.6B heads,
        # 127 registers in bf16 / 124 in fp32, no spills, 4 blocks per SM
        # (BLOCK_N=32: 167 registers, 3 blocks; 64: 255 and spills).
        return AttentionTiles(block_m=max(16, group_pad), block_n=16, num_warps=4, num_stages=2)
    block_m = 16 if rows_needed <= 16 else (32 if wide else 64)
    block_n = 32 if wide else 64
    return AttentionTiles(
        block_m=max(block_m, group_pad),
        block_n=block_n,
        # 16-bit prefill tiles spill with 4 warps (255 registers, sm_90), not with 8 (188);
        # float64 tiles need 8 warps to spill less; float32 spills with 8, not 4.
        num_warps=8 if dtype.itemsize in (2, 8) else 4,
        num_stages=1 if dtype.itemsize >= 4 else 2,
    )


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
