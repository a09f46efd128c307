"""servelab's CPU matmul over packed weights (`servelab.kernels.cpu_linear`) and
the model's switch to it (`engine.cpu_kernels`).

Kernel level: against the exact product (float64 of float32 inputs, or the
float64 result, compared with the standard rounding-error bound of a length-K
dot product: |error| <= K * u * sum_k |x_k * w_k|, u the unit roundoff, plus one
rounding for the bias) for row counts around the 8-row micro-kernel and the
64-row blocks, widths around the packed panels (32 float32 / 16 float64
columns), odd inner sizes, a bias, strided rows and 1/2 threads (bit-identical).

Engine level: the option's errors name the choices and the reason (that the
model's kernel program follows its parameters is `test_kernel_forward.py`). The token-level proof is the
oracle (`test_oracle.py`), which runs every combination with the kernels on.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from servelab.engine.build import build_engine
from servelab.errors import ConfigError
from servelab.kernels import cpu_linear
from servelab.testing.oracle import restored_num_threads

KERNEL = cpu_linear  # see conftest.needs_the_kernel


def unit_roundoff(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps / 2


def assert_within_rounding(out, x, weight, bias=None):
    """`out` is x @ weight.T (+ bias) up to the rounding of length-K dot products."""
    exact = x.double() @ weight.double().T
    magnitude = x.double().abs() @ weight.double().abs().T
    if bias is not None:
        exact = exact + bias.double()
        magnitude = magnitude + bias.double().abs()
    u = unit_roundoff(x.dtype)
    bound = (x.shape[1] + 1) * u * magnitude + u * exact.abs()
    error = (out.double() - exact).abs()
    assert out.shape == exact.shape and out.dtype == x.dtype
    assert bool((error <= bound).all()), f"max excess {(error - bound).max().item():.3e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("rows", [0, 1, 7, 8, 9, 64, 65, 130])
@pytest.mark.parametrize("out_features,in_features", [(32, 64), (40, 13), (1000, 72), (256, 512)])
def test_matches_the_exact_product(dtype, rows, out_features, in_features):
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features, generator=gen, dtype=dtype)
    weight = torch.randn(out_features, in_features, generator=gen, dtype=dtype)
    out = cpu_linear.PackedLinear(weight, None)(x)
    assert_within_rounding(out, x, weight)
    # the bound is not vacuous: the library's own product meets it too, and ours is close to it
    assert_within_rounding(F.linear(x, weight), x, weight)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_bias_strided_rows_and_leading_dims(dtype):
    gen = torch.Generator().manual_seed(1)
    wide = torch.randn(70, 3, 100, generator=gen, dtype=dtype)
    x = wide[:, 1, :72]  # rows 300 elements apart, each contiguous
    weight = torch.randn(50, 72, generator=gen, dtype=dtype)
    bias = torch.randn(50, generator=gen, dtype=dtype)
    packed = cpu_linear.PackedLinear(weight, bias)
    out = packed(x)
    assert_within_rounding(out, x, weight, bias)
    batched = packed(x.reshape(7, 10, 72))
    assert batched.shape == (7, 10, 50)
    assert torch.equal(batched.reshape(70, 50), out)


def test_thread_count_never_changes_a_result():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(97, 256, generator=gen)
    packed = cpu_linear.PackedLinear(torch.randn(1000, 256, generator=gen), None)
    with restored_num_threads(1):
        one = packed(x)
    with restored_num_threads(2):
        two = packed(x)
    assert torch.equal(one, two)


def test_errors_name_the_problem():
    module = cpu_linear.kernel()
    weight = torch.randn(64, 32)
    packed = cpu_linear.PackedLinear(weight, None)
    with pytest.raises(RuntimeError, match="share a dtype"):
        packed(torch.randn(4, 32, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="in_features = 16"):
        packed(torch.randn(4, 16))
    with pytest.raises(RuntimeError, match="contiguous rows"):
        packed(torch.randn(32, 4).T)
    with pytest.raises(RuntimeError, match="float32 or float64"):
        module.pack_weight(weight.half())
    with pytest.raises(RuntimeError, match="pack_bias"):
        module.linear(torch.randn(4, 32), packed.packed, torch.randn(50), 64)


def tiny_engine(**engine):
    return build_engine({"model": "tiny", "engine": {"kv_cache_memory": "1MiB", **engine}})


def test_engine_option_turns_the_kernels_on_and_off():
    assert tiny_engine().executor.runner.cpu_kernels
    assert tiny_engine(cpu_kernels="on").executor.runner.cpu_kernels
    assert not tiny_engine(cpu_kernels="off").executor.runner.cpu_kernels


def test_engine_option_errors_name_choices_and_reasons():
    with pytest.raises(ConfigError, match="auto, on, off"):
        tiny_engine(cpu_kernels="fast")
    # bfloat16 weights run the kernel path too, with float32 activations (cpu_matmul)
    assert tiny_engine(cpu_kernels="on", dtype="bfloat16").executor.runner.cpu_kernels


def test_switched_off_kernels_leave_torch_matmuls(monkeypatch):
    monkeypatch.setenv("SERVELAB_CPU_KERNEL", "0")
    cpu_linear.kernel.cache_clear()
    try:
        assert not tiny_engine().executor.runner.cpu_kernels
        with pytest.raises(ConfigError, match="SERVELAB_CPU_KERNEL=0"):
            tiny_engine(cpu_kernels="on")
    finally:
        cpu_linear.kernel.cache_clear()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("rows", [1, 8, 9, 65])
@pytest.mark.parametrize("inner,in_features", [(16, 32), (40, 72), (512, 256)])
def test_gated_matmul_is_swiglu(dtype, rows, inner, in_features):
    """`linear_gated` = silu(x @ gate.T) * (x @ up.T) of a [gate; up] weight, the
    SwiGLU of the fused gate/up projection, against float64 of the same inputs
    (float32: the products' rounding bound carried through silu and the product,
    with slack for the polynomial exp's few ulps)."""
    module = cpu_linear.kernel()
    gen = torch.Generator().manual_seed(rows + inner)
    x = torch.randn(rows, in_features, generator=gen, dtype=dtype)
    weight = torch.randn(2 * inner, in_features, generator=gen, dtype=dtype) * 0.2
    out = module.linear_gated(x, module.pack_gated_weight(weight), inner)
    exact = x.double() @ weight.double().T
    gate, up = exact[:, :inner], exact[:, inner:]
    want = torch.nn.functional.silu(gate) * up
    magnitude = x.double().abs() @ weight.double().abs().T
    u = unit_roundoff(dtype)
    # |d silu| <= 1.1 and |d(ab)| = |a| |db| + |b| |da|: first-order error propagation
    dot_error = (in_features + 1) * u * magnitude
    bound = 1.1 * dot_error[:, :inner] * up.abs() + gate.abs() * dot_error[:, inner:]
    bound = bound + 16 * u * want.abs() + 16 * u
    assert out.shape == (rows, inner) and out.dtype == dtype
    assert bool(((out.double() - want).abs() <= bound).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gated_matmul_extreme_gates(dtype):
    """SwiGLU's exp(-g) overflowing (g very negative: silu -> -0) or vanishing
    (g very positive: silu -> g), gates around the float32 exp range's ends and
    a dense sweep across it (every reduction interval of exp). Each row is
    x = [g, u] against a gate row [1, 0] and an up row [0, 1], so the matmul
    hands the epilogue g and u exactly; tolerances as for the other fused ops
    (float32 1e-6, float64 1e-12)."""
    module = cpu_linear.kernel()
    ends = torch.tensor(
        [-1e4, -200.0, -100.0, -89.5, -88.5, -87.5, -20.0, -1e-3, 0.0, 1e-3, 20.0, 86.5, 87.5,
         88.5, 100.0, 1e4, -1e38, 1e38],
        dtype=dtype,
    )  # fmt: skip
    gate = torch.cat([ends, torch.linspace(-95, 95, 40001, dtype=dtype)])
    up = torch.linspace(-2, 3, gate.numel(), dtype=dtype)
    weight = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=dtype)  # [gate row; up row]
    out = module.linear_gated(torch.stack([gate, up], dim=1), module.pack_gated_weight(weight), 1)
    assert torch.isfinite(out).all()
    tolerance = 1e-6 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(
        out[:, 0], torch.nn.functional.silu(gate) * up, rtol=tolerance, atol=tolerance
    )


def test_gated_matmul_thread_count_and_errors():
    module = cpu_linear.kernel()
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(70, 64, generator=gen)
    packed = module.pack_gated_weight(torch.randn(2 * 100, 64, generator=gen))
    with restored_num_threads(1):
        one = module.linear_gated(x, packed, 100)
    with restored_num_threads(2):
        two = module.linear_gated(x, packed, 100)
    assert torch.equal(one, two)
    assert module.linear_gated(x[:0], packed, 100).shape == (0, 100)
    with pytest.raises(RuntimeError, match="gate, then up"):
        module.pack_gated_weight(torch.randn(7, 64))
    with pytest.raises(RuntimeError, match="share a dtype"):
        module.linear_gated(x.double(), packed, 100)
    with pytest.raises(RuntimeError, match="in_features = 32"):
        module.linear_gated(torch.randn(3, 32), packed, 100)


# -- one row over bfloat16 weights (`csrc/cpu_gemv_bf16.h`), on CPUs with AVX512-BF16
def gemv_kernel():
    module = cpu_linear.kernel()
    if module is None or not module.gemv_bf16_available():
        pytest.skip("the bf16 row kernel needs a CPU with AVX512-BF16 (this build has none)")
    return module


@pytest.mark.parametrize("m, n, k", [(1, 1, 1), (1, 7, 5), (1, 9, 130), (1, 1031, 1000),
                                     (1, 4096, 1024), (3, 33, 129)])  # fmt: skip
@pytest.mark.parametrize("threads", [1, 2])
def test_gemv_bf16_is_the_product_of_the_bf16_rounded_row(m, n, k, threads):
    """x is rounded to bf16 as oneDNN's bf16 matmul rounds it; then the float32 sum of
    exact bf16 products (any k, tails of every length, rows past a thread's share)."""
    module = gemv_kernel()
    g = torch.Generator().manual_seed(n * k)
    x = torch.randn(m, k, generator=g)
    weight = torch.randn(n, k, generator=g).to(torch.bfloat16)
    with restored_num_threads(threads):
        out = module.gemv_bf16(x, weight, None, False)
    assert out.dtype == torch.float32 and out.shape == (m, n)
    assert_within_rounding(out, x.to(torch.bfloat16).float(), weight.float())


def test_gemv_bf16_gives_the_same_result_on_one_and_two_threads():
    module = gemv_kernel()
    x, weight = torch.randn(1, 1000), torch.randn(777, 1000).to(torch.bfloat16)
    with restored_num_threads(1):
        one = module.gemv_bf16(x, weight, None, False)
    with restored_num_threads(2):
        two = module.gemv_bf16(x, weight, None, False)
    assert torch.equal(one, two)


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_gemv_bf16_adds_the_bias_then_rounds_as_torch_does(x_dtype):
    """With a bf16 bias and `round`: exactly the float32 sum plus the widened bias,
    rounded by torch's own conversion, whether x comes in float32 or bf16."""
    module = gemv_kernel()
    g = torch.Generator().manual_seed(11)
    x = torch.randn(1, 300, generator=g).to(x_dtype)
    weight = torch.randn(517, 300, generator=g).to(torch.bfloat16)
    bias = torch.randn(517, generator=g).to(torch.bfloat16)
    plain = module.gemv_bf16(x, weight, None, False)
    expected = (plain + bias.float()).to(torch.bfloat16).float()
    assert torch.equal(module.gemv_bf16(x, weight, bias, True), expected)
    assert not torch.equal(expected, plain + bias.float())  # the rounding was needed
    with pytest.raises(RuntimeError, match="bias must be bfloat16"):
        module.gemv_bf16(x, weight, bias.float(), True)


def test_a_bf16_projection_takes_the_row_kernel_for_one_row_and_onednn_for_more():
    """`PackedMatmul` over a bf16 weight (oneDNN's native path): one row through the row
    kernel, over the weight as given (no copy), within a bf16 rounding of oneDNN's
    result; two rows through oneDNN, unchanged."""
    from servelab.executor.kernel_forward import PackedMatmul
    from servelab.kernels import cpu_matmul

    gemv_kernel()
    if cpu_matmul.path_for(torch.bfloat16).name != "onednn":
        pytest.skip("oneDNN's native bf16 path needs AVX512-BF16 or AMX")
    weight = torch.randn(300, 64).to(torch.bfloat16)
    bias = torch.randn(300).to(torch.bfloat16)
    matmul = PackedMatmul(weight, bias)
    assert matmul.bf16_row is not None and matmul.weight.data_ptr() == weight.data_ptr()
    x = torch.randn(2, 64)
    onednn = torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), matmul.packed,
                                                matmul.bias, "none", [], "")  # fmt: skip
    one = matmul.native(x[:1])
    assert one.dtype == torch.bfloat16
    torch.testing.assert_close(one.float(), onednn[:1].float(), rtol=2**-7, atol=2**-7)
    assert torch.equal(matmul.native(x), onednn)  # two rows: oneDNN's own result
