"""The fused Triton kernels (`servelab.kernels.triton_fused`) against the torch
ops they replace, under the interpreter on a CPU (compiled where CUDA is).

The interpreter truncates float32 to bfloat16 where a GPU rounds to nearest,
so 16-bit results are compared within a few bf16 steps; float32 and float64
differ from torch only by the norm's summation order (a few units in the
last place); the residual sum is exact (but for the interpreter's bf16)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from servelab.kernels import triton_fused as tf
from servelab.model.transformer import apply_rope, rms_norm

DEVICE = "cpu" if tf.INTERPRETED else "cuda"
pytestmark = [
    pytest.mark.gpu_path,
    pytest.mark.skipif(
        DEVICE == "cuda" and not torch.cuda.is_available(),
        reason="Triton kernels compiled (TRITON_INTERPRET=0) and no CUDA device to run them on",
    ),
]
TOL = {  # (atol, rtol)
    torch.float64: (1e-14, 1e-14),
    torch.float32: (1e-6, 4e-7),
    torch.bfloat16: (2**-6, 2**-5),
}
DTYPES = list(TOL)


def randn(*shape, dtype, seed, scale=1.0, offset=0.0):
    g = torch.Generator().manual_seed(seed)
    return (offset + scale * torch.randn(*shape, generator=g, dtype=torch.float64)).to(
        dtype=dtype, device=DEVICE
    )


def assert_close(got, want):
    atol, rtol = TOL[got.dtype]
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm_matches_torch(dtype, with_residual):
    x = randn(5, 96, dtype=dtype, seed=1)
    residual = randn(5, 96, dtype=dtype, seed=2)
    weight = randn(96, dtype=dtype, seed=3, scale=0.1, offset=1.0)
    total = x + residual if with_residual else x
    out, new_residual = tf.add_rms_norm(
        x, residual.clone() if with_residual else None, weight, 1e-6
    )
    if dtype == torch.bfloat16 and tf.INTERPRETED:  # truncated, not rounded (module doc)
        assert_close(new_residual, total)
    else:
        assert torch.equal(new_residual, total)  # one rounded add: exact
    assert_close(out, rms_norm(total, weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [True, False])
def test_qk_norm_rope_matches_torch(dtype, qk_norm):
    heads, kv_heads, head_dim = 4, 2, 16
    qkv = randn(6, heads + 2 * kv_heads, head_dim, dtype=dtype, seed=4)
    q_w = randn(head_dim, dtype=dtype, seed=5, scale=0.1, offset=1.0)
    k_w = randn(head_dim, dtype=dtype, seed=6, scale=0.1, offset=1.0)
    cos = randn(40, head_dim // 2, dtype=dtype, seed=7).cos()
    sin = randn(40, head_dim // 2, dtype=dtype, seed=7).sin()
    positions = torch.tensor([3, 0, 7, 39, 12, 12], device=DEVICE)
    qk = qkv[:, : heads + kv_heads]
    if qk_norm:
        weight = torch.cat([q_w.expand(heads, head_dim), k_w.expand(kv_heads, head_dim)])
        qk = rms_norm(qk, weight, 1e-6)
    want = apply_rope(qk, cos[positions].unsqueeze(1), sin[positions].unsqueeze(1))
    got = qkv.clone()
    weights = (q_w, k_w) if qk_norm else (None, None)
    tf.qk_norm_rope(got, heads, kv_heads, *weights, 1e-6, cos, sin, positions)
    assert_close(got[:, : heads + kv_heads], want)
    assert torch.equal(got[:, heads + kv_heads :], qkv[:, heads + kv_heads :])  # v untouched


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_torch(dtype):
    gate_up = randn(3, 2 * 80, dtype=dtype, seed=8, scale=3.0)
    gate, up = gate_up.chunk(2, dim=-1)
    assert_close(tf.silu_mul(gate_up), F.silu(gate) * up)


def test_empty_batches_launch_nothing():
    x = torch.empty(0, 8, device=DEVICE)
    out, residual = tf.add_rms_norm(x, None, torch.ones(8, device=DEVICE), 1e-6)
    assert out.shape == (0, 8) and residual is x
    assert tf.silu_mul(torch.empty(0, 8, device=DEVICE)).shape == (0, 4)
