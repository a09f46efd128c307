"""Triton kernels that fuse a decoder layer's small ops on CUDA: residual add +
RMSNorm, q/k RMSNorm + RoPE (in place on the fused qkv output), SiLU-and-mul.

Each replaces a chain of torch ops (RMSNorm alone is seven) with one launch,
and repeats torch's roundings: 16-bit values are rounded to their dtype
wherever torch's op chain stores a 16-bit tensor, so results equal the torch
path up to the order of the norm's sum. float64 computes in float64.

Without a CUDA device (and unless the user chose) this module sets
`TRITON_INTERPRET=1` before defining its kernels, as the attention kernels
do; reductions use `tl.reduce` with a combine function for the same reason.
"""

from __future__ import annotations

import os

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402  (must follow the TRITON_INTERPRET decision)
import triton.language as tl  # noqa: E402

_SUM = tl.standard._sum_combine
_TL = {
    torch.float16: tl.float16,
    torch.bfloat16: tl.bfloat16,
    torch.float32: tl.float32,
    torch.float64: tl.float64,
}


@triton.jit(do_not_specialize=["eps"])
def _add_rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    eps,
    stride_x,
    stride_r,
    stride_o,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    DT: tl.constexpr,
    ACC: tl.constexpr,
):
    """One row: s = x + residual (stored back into residual), out = rms_norm(s) * weight."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=ok, other=0.0)
        x = (x.to(ACC) + r.to(ACC)).to(DT)  # torch's add rounds to the dtype
        tl.store(residual_ptr + row * stride_r + cols, x, mask=ok)
    xf = x.to(ACC)
    variance = tl.reduce(xf * xf, 0, _SUM) / N
    y = (xf * tl.rsqrt(variance + eps)).to(DT)
    w = tl.load(weight_ptr + cols, mask=ok, other=0.0)
    tl.store(out_ptr + row * stride_o + cols, (w.to(ACC) * y.to(ACC)).to(DT), mask=ok)


@triton.jit(do_not_specialize=["eps"])
def _qk_norm_rope_kernel(
    qkv_ptr,
    q_weight_ptr,
    k_weight_ptr,
    cos_ptr,
    sin_ptr,
    positions_ptr,
    eps,
    stride_t,
    stride_h,
    stride_cos,
    NUM_HEADS: tl.constexpr,
    NUM_QK_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HAS_NORM: tl.constexpr,
    DT: tl.constexpr,
    ACC: tl.constexpr,
):
    """One token: its q and k heads normalised per head (Qwen3) and rotated
    (rotate-half RoPE at the token's position), in place."""
    token = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HALF)
    ok = (heads < NUM_QK_HEADS)[:, None]
    base = qkv_ptr + token * stride_t + heads[:, None] * stride_h + dims[None, :]
    x1 = tl.load(base, mask=ok, other=0.0).to(ACC)
    x2 = tl.load(base + HALF, mask=ok, other=0.0).to(ACC)
    if HAS_NORM:
        total = tl.reduce(x1 * x1, 1, _SUM) + tl.reduce(x2 * x2, 1, _SUM)
        inv = tl.rsqrt(total / (2 * HALF) + eps)
        is_q = (heads < NUM_HEADS)[:, None]
        w1 = tl.where(
            is_q, tl.load(q_weight_ptr + dims)[None, :], tl.load(k_weight_ptr + dims)[None, :]
        )
        w2 = tl.where(
            is_q,
            tl.load(q_weight_ptr + HALF + dims)[None, :],
            tl.load(k_weight_ptr + HALF + dims)[None, :],
        )
        x1 = (w1.to(ACC) * (x1 * inv[:, None]).to(DT).to(ACC)).to(DT).to(ACC)
        x2 = (w2.to(ACC) * (x2 * inv[:, None]).to(DT).to(ACC)).to(DT).to(ACC)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    cos = tl.load(cos_ptr + pos * stride_cos + dims).to(ACC)[None, :]
    sin = tl.load(sin_ptr + pos * stride_cos + dims).to(ACC)[None, :]
    # torch's x1 * cos - x2 * sin: each product rounded, then the difference
    out1 = ((x1 * cos).to(DT).to(ACC) - (x2 * sin).to(DT).to(ACC)).to(DT)
    out2 = ((x2 * cos).to(DT).to(ACC) + (x1 * sin).to(DT).to(ACC)).to(DT)
    tl.store(base, out1, mask=ok)
    tl.store(base + HALF, out2, mask=ok)


@triton.jit
def _silu_mul_kernel(
    gate_up_ptr,
    out_ptr,
    stride_g,
    stride_o,
    INNER: tl.constexpr,
    BLOCK: tl.constexpr,
    DT: tl.constexpr,
    ACC: tl.constexpr,
):
    """silu(gate) * up for one row's BLOCK columns; gate_up is [gate | up]."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < INNER
    gate = tl.load(gate_up_ptr + row * stride_g + cols, mask=ok, other=0.0).to(ACC)
    up = tl.load(gate_up_ptr + row * stride_g + INNER + cols, mask=ok, other=0.0).to(ACC)
    act = (gate / (1.0 + tl.exp(-gate))).to(DT).to(ACC)
    tl.store(out_ptr + row * stride_o + cols, (act * up).to(DT), mask=ok)


INTERPRETED: bool = type(_add_rms_norm_kernel).__name__ == "InterpretedFunction"
SILU_BLOCK = 1024


def _acc(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(rms_norm(x + residual) * weight, x + residual)` for `x` [T, N]; the sum
    is written into `residual` (in place). With `residual` None: `(rms_norm(x) *
    weight, x)`. One launch."""
    num_rows, n = x.shape
    out = torch.empty_like(x)
    if num_rows:
        has_residual = residual is not None
        r = residual if has_residual else x
        _add_rms_norm_kernel[(num_rows,)](
            x, r, weight, out, eps, x.stride(0), r.stride(0), out.stride(0),
            N=n, BLOCK=triton.next_power_of_2(n), HAS_RESIDUAL=has_residual,
            DT=_TL[x.dtype], ACC=_acc(x.dtype),
        )  # fmt: skip
    return out, (residual if residual is not None else x)


def qk_norm_rope(
    qkv: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
) -> None:
    """In place on `qkv` [T, num_heads + 2 * num_kv_heads, D] (rows contiguous
    per head): per-head RMSNorm of q and k heads when weights are given, then
    RoPE at `positions` from the full tables `cos`, `sin` [max_pos, D / 2]."""
    num_tokens, _, head_dim = qkv.shape
    if not num_tokens:
        return
    assert qkv.stride(2) == 1 and cos.stride(1) == 1 and cos.stride() == sin.stride()
    has_norm = q_weight is not None
    _qk_norm_rope_kernel[(num_tokens,)](
        qkv, q_weight if has_norm else cos, k_weight if has_norm else cos, cos, sin,
        positions, eps, qkv.stride(0), qkv.stride(1), cos.stride(0),
        NUM_HEADS=num_heads, NUM_QK_HEADS=num_heads + num_kv_heads,
        HEADS_PAD=triton.next_power_of_2(num_heads + num_kv_heads), HALF=head_dim // 2,
        HAS_NORM=has_norm, DT=_TL[qkv.dtype], ACC=_acc(qkv.dtype),
    )  # fmt: skip


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` for `gate_up` [T, 2 * inner] = [gate | up]. One launch."""
    num_rows, width = gate_up.shape
    inner = width // 2
    out = torch.empty(num_rows, inner, dtype=gate_up.dtype, device=gate_up.device)
    if num_rows:
        block = min(SILU_BLOCK, triton.next_power_of_2(inner))
        _silu_mul_kernel[(num_rows, triton.cdiv(inner, block))](
            gate_up, out, gate_up.stride(0), out.stride(0),
            INNER=inner, BLOCK=block, DT=_TL[gate_up.dtype], ACC=_acc(gate_up.dtype),
        )  # fmt: skip
    return out


def compile_specs(hidden, heads, kv_heads, head_dim, inner, dtype):
    """(kernel, constexprs + `_shape` + `_num_warps`, pointer kinds, fp32 args) of
    each kernel as the functions above launch it: for the sm_90 compile check.
    Pointer kind "x" means the activation dtype."""
    dt, acc = _TL[dtype], _acc(dtype)
    qk = heads + kv_heads
    return [
        (
            _add_rms_norm_kernel,
            dict(N=hidden, BLOCK=triton.next_power_of_2(hidden), HAS_RESIDUAL=True, DT=dt,
                 ACC=acc, _shape=f"hidden {hidden}", _num_warps=4),
            dict(x_ptr="x", residual_ptr="x", weight_ptr="x", out_ptr="x"),
            ("eps",),
        ),
        (
            _qk_norm_rope_kernel,
            dict(NUM_HEADS=heads, NUM_QK_HEADS=qk, HEADS_PAD=triton.next_power_of_2(qk),
                 HALF=head_dim // 2, HAS_NORM=True, DT=dt, ACC=acc,
                 _shape=f"{heads}+{kv_heads} heads, d {head_dim}", _num_warps=4),
            dict(qkv_ptr="x", q_weight_ptr="x", k_weight_ptr="x", cos_ptr="x", sin_ptr="x",
                 positions_ptr="i64"),
            ("eps",),
        ),
        (
            _silu_mul_kernel,
            dict(INNER=inner, BLOCK=min(SILU_BLOCK, triton.next_power_of_2(inner)), DT=dt,
                 ACC=acc, _shape=f"inner {inner}", _num_warps=4),
            dict(gate_up_ptr="x", out_ptr="x"),
            (),
        ),
    ]  # fmt: skip
