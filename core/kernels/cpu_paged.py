"""A C++ paged decode-attention kernel for the CPU, and its K/V store.

Decode attention on a CPU is bound by memory traffic: gathering pages for SDPA
reads and writes the context three times, while `paged_decode`
(`csrc/cpu_paged.h`) reads each key and value once, through the block table,
with an online softmax. Contract: float32, float64 (C-library `exp`: the oracle's
dtype), or bfloat16 (q and caches; widened to float32 as read, summed in float32,
the output rounded to bfloat16 once: half float32's bytes read; on AVX512-BF16 and
heads of whole 32-element registers the scores are summed from the same exact
products by `vdpbf16ps`, in another order, and the values widened without shuffles); head_dim in
`HEAD_DIMS`; any block size and grouped-query ratio; float32 matches SDPA to
rounding, not bit for bit; results never depend on the thread count.
`store_kv` is `servelab.plugins.attention.per_request.store_kv` in one call.

`paged_prefill_bf16` (`csrc/cpu_prefill_bf16.h`, CPUs with AVX512-BF16 only) is
the prompt chunks' causal attention over bf16 caches, through the block table:
scores from exact bf16 products summed in float32 by `vdpbf16ps`, the softmax
in float32, each probability rounded to bf16 before it weights the values (as
torch's bf16 flash kernel rounds it). Without a build, callers take the SDPA
path (the fallback rule is in `servelab.kernels.cpp_extension`).
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


def prefill_bf16_available() -> bool:
    """Whether `paged_prefill_bf16` runs here: the kernel is built, for a CPU with
    AVX512-BF16."""
    module = kernel()
    return module is not None and module.paged_prefill_bf16_available()


def paged_prefill_bf16(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    q_starts: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
) -> None:
    """Prompt chunks' causal attention over bfloat16 caches, into `out`: sequence i's
    queries are rows `q_starts[i]:q_starts[i + 1]` of `q` `[tokens, num_heads,
    head_dim]`, over its `seq_lens[i]` keys through row i of `block_tables`, query j
    of `lq` seeing keys `0 .. seq_lens[i] - lq + j`; those rows of `out` (contiguous,
    `q`'s shape) are written, no other. Int32 tables, starts and lengths. Scores
    are summed in float32 from exact bf16 products, the softmax and the weighted
    values in float32, the output rounded to bfloat16 once. Check
    `prefill_bf16_available` first."""
    module = kernel()
    assert module is not None, "the CPU paged-decode kernel is not built: check problems()"
    module.paged_prefill_bf16(
        q, k_cache, v_cache, block_tables, q_starts, seq_lens, float(scale), out
    )


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
