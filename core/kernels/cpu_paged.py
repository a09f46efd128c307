"""A C++ paged decode-attention kernel for the CPU, and its K/V store.

Decode attention on a CPU is bound by memory traffic: gathering pages for SDPA
reads and writes the context three times, while `paged_decode`
(`csrc/cpu_paged.h`) reads each key and value once, through the block table,
with an online softmax. Contract: float32, float64 (C-library `exp`: the oracle's
dtype), or bfloat16 (q and caches; widened to float32 as read, summed in float32,
the output rounded to bfloat16 once: half float32's bytes read); head_dim in
`HEAD_DIMS`; any block size and grouped-query ratio; float32 matches SDPA to
rounding, not bit for bit; results never depend on the thread count.
`store_kv` is `servelab.plugins.attention.per_request.store_kv` in one call. Without a build, callers take the
SDPA path (the fallback rule is in `servelab.kernels.cpp_extension`).
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from servelab.kernels.cpp_extension import BUILD_PROBLEM, build, placement_problems

HEAD_DIMS = (16, 32, 64, 128, 256)
DTYPES = (torch.float32, torch.float64, torch.bfloat16)


@functools.cache
def kernel() -> ModuleType | None:
    """The compiled extension, or None (logged once) when it cannot be built."""
    return build(
        "servelab_cpu_paged_decode",
        "cpu_paged.cpp",
        what="CPU paged-decode kernel",
        fallback="decode attention uses gathered pages and SDPA instead",
    )


def problems(device: torch.device, dtype: torch.dtype, head_dim: int) -> list[str]:
    """Every constraint of the kernel this configuration breaks (empty: usable).
    Builds the kernel (see `kernel`) when the rest holds."""
    found = placement_problems(device, dtype, DTYPES)
    if head_dim not in HEAD_DIMS:
        found.append(f"head_dim must be one of {HEAD_DIMS} (got {head_dim})")
    if not found and kernel() is None:
        found.append(BUILD_PROBLEM)
    return found


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query per sequence over its whole paged context: `q` `[num_seqs,
    num_heads, head_dim]` -> a new contiguous tensor of that shape. `q` may be
    a view with any token stride (each token's heads contiguous, as a slice of
    a fused QKV projection is); `block_tables` (int32) and `seq_lens` (int32)
    may have more rows than `q`: the first `num_seqs` are read. Check
    `problems` first."""
    module = kernel()
    assert module is not None, "the CPU paged-decode kernel is not built: check problems()"
    return module.paged_decode(q, k_cache, v_cache, block_tables, seq_lens, float(scale))


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """`servelab.plugins.attention.per_request.store_kv` in one call (same rule: every slot valid; here also the
    same dtype as the caches and each token's heads contiguous). Check `problems` first."""
    module = kernel()
    assert module is not None, "the CPU paged-decode kernel is not built: check problems()"
    module.store_kv(k, v, k_cache, v_cache, slot_mapping)
