"""Fused C++ CPU kernels for a decoder layer's element-wise ops.

A layer's RMSNorms, residual adds, Qwen3 q/k per-head norms and RoPE are each a
handful of small torch ops whose per-call cost outweighs their arithmetic at
decode sizes; here each is one call and one pass over the rows
(`csrc/cpu_fused.h`), computing `servelab.model.transformer`'s formulas in the
tensors' dtype (float32 or float64; positions int64) to rounding, never
depending on the thread count. A wrong dtype, shape, layout or device raises
`RuntimeError` naming the problem; `qk_norm_rope_` checks every position before
it writes. Without a build: the torch ops (see `servelab.kernels.cpp_extension`).
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from servelab.kernels.cpp_extension import (
    BUILD_PROBLEM,
    build,
    header_constant,
    placement_problems,
)

DTYPES = (torch.float32, torch.float64)
# The least work (about one element's worth a unit) a call needs before its rows
# are split over threads; defined, with how it was chosen, in csrc/cpu_fused.h.
PARALLEL_MIN_WORK = header_constant("cpu_fused.h", "kParallelMinWork")


@functools.cache
def kernel() -> ModuleType | None:
    """The compiled extension, or None (logged once) when it cannot be built."""
    return build(
        "servelab_cpu_fused",
        "cpu_fused.cpp",
        what="CPU fused element-wise kernels",
        fallback="the model's norms and RoPE run as torch ops instead",
    )


def problems(device: torch.device, dtype: torch.dtype) -> list[str]:
    """Every constraint of the kernels this configuration breaks (empty: usable).
    Builds the kernels (see `kernel`) when the rest holds."""
    found = placement_problems(device, dtype, DTYPES)
    if not found and kernel() is None:
        found.append(BUILD_PROBLEM)
    return found


def _module() -> ModuleType:
    module = kernel()
    assert module is not None, "the CPU fused kernels are not built: check problems()"
    return module


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`x * rsqrt(mean(x * x, -1) + eps) * weight` for x `[T, H]` (last dim
    contiguous, any row stride) and weight `[H]` of x's dtype: a new contiguous
    `[T, H]`."""
    return _module().rms_norm(x, weight, float(eps))


def add_rms_norm(
    residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """`residual += delta` in place (residual `[T, H]` contiguous, delta `[T, H]`
    with any row stride), then `rms_norm(residual, weight, eps)` as a new tensor."""
    return _module().add_rms_norm(residual, delta, weight, float(eps))


def qk_norm_rope_(
    qkv: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
) -> None:
    """In place on a fused QKV projection `[T, (num_heads + 2 * num_kv_heads) *
    head_dim]` (contiguous): each q head RMSNormed with `q_weight` `[head_dim]`
    (each k head with `k_weight`) when given, then rotate-half RoPE with rows
    `positions` (int64 `[T]`) of the `cos`/`sin` tables `[max_positions,
    head_dim / 2]`; the v heads are untouched. What `transformer.apply_rope(
    transformer.rms_norm(qk, ...), cos[positions], sin[positions])` computes."""
    _module().qk_norm_rope_(
        qkv, q_weight, k_weight, float(eps), cos, sin, positions, int(num_heads), int(num_kv_heads)
    )


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(dim=-1)` for `[rows, n]` (last dim contiguous): int64
    `[rows]`, the first index of each row's largest value, NaN counting as the
    largest (torch's rules). Single-threaded: a greedy step's logits are a few
    hundred kilobytes, too few for a parallel region to pay."""
    return _module().argmax_rows(logits)
