"""`cpu_matmul`: the path each weight dtype takes on this CPU, and that each
path computes `F.linear` (checked in float64) to its dtype's rounding."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from servelab.executor.kernel_forward import PackedMatmul, silu_mul
from servelab.kernels import cpu_linear, cpu_matmul


def test_paths_follow_the_cpu(caplog):
    avx512 = torch.backends.cpu.get_cpu_capability().startswith("AVX512")
    native_bf16 = torch.ops.mkldnn._is_mkldnn_bf16_supported() and bool(
        {"amx_bf16", "avx512_bf16"} & cpu_matmul.cpu_flags()
    )
    cpu_matmul.path_for.cache_clear()
    with caplog.at_level(logging.INFO, logger="servelab.kernels.cpu_matmul"):
        assert cpu_matmul.path_for(torch.float64).name == "servelab"
        assert cpu_matmul.path_for(torch.float32).name == ("servelab" if avx512 else "onednn")
        bf16 = cpu_matmul.path_for(torch.bfloat16)
    assert bf16.name == ("onednn" if native_bf16 else "onednn-upcast")
    assert bf16.compute_dtype == (torch.bfloat16 if native_bf16 else torch.float32)
    logged = [r.getMessage() for r in caplog.records if "CPU matmul" in r.getMessage()]
    assert len(logged) == 3 and all("(" in line for line in logged)  # each names why


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("rows", [1, 2, 3, 37])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_matmul_is_linear(dtype, rows, with_bias):
    if cpu_matmul.path_for(dtype).name == "servelab" and cpu_linear.kernel() is None:
        pytest.skip("servelab's matmul kernel is not built here")
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(70, 48, generator=gen).to(dtype)
    bias = torch.randn(70, generator=gen).to(dtype) if with_bias else None
    x = torch.randn(rows, 48, generator=gen)
    out = PackedMatmul(weight, bias)(x.to(dtype))
    expected = F.linear(
        x.to(dtype).double(), weight.double(), None if bias is None else bias.double()
    )
    assert out.shape == (rows, 70)
    assert out.dtype == (torch.float32 if dtype == torch.bfloat16 else dtype)
    path = cpu_matmul.path_for(dtype)
    # bf16 on the matrix units rounds the input to bf16 (it already is): fp32 accumulation
    tol = {torch.float64: 1e-12, torch.float32: 1e-4, torch.bfloat16: 1e-2}[dtype]
    if path.compute_dtype == torch.bfloat16:
        tol = 5e-2  # oneDNN may round its output to bfloat16
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)
    # `native` is the same product before it is widened: in the path's compute dtype
    native = PackedMatmul(weight, bias).native(x.to(dtype))
    assert native.dtype == (path.compute_dtype if path.name != "servelab" else dtype)
    assert torch.equal(native.to(out.dtype), out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_is_the_models_formula(dtype):
    """In the input's dtype, with the model's roundings: exactly its ops."""
    x = torch.randn(5, 12, generator=torch.Generator().manual_seed(0)).to(dtype)
    out = silu_mul(x, 6)
    assert out.dtype == dtype
    assert torch.equal(out, F.silu(x[:, :6]) * x[:, 6:])
