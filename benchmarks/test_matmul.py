"""Matmuls: servelab's packed-weight CPU kernel (`servelab.kernels.cpu_linear`)
next to `F.linear` (MKL) on the reference model's projection shapes, for the
row counts a step has: 1, 8, 32 and 64 decoding sequences, a 2,048-token
prompt chunk. `gflops` is each row's rate at its median.

The kernel rows need the C++ extension (skipped, with the reason, where it
does not build or `SERVELAB_CPU_KERNEL=0`); CUDA runs are not this group's
subject (the kernel is CPU-only).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from reference_workload import NUM_THREADS, SMOKE

from servelab.kernels import cpu_linear
from servelab.model.config import named_config

ROWS = (1, 8) if SMOKE else (1, 8, 32, 64, 2048)
ROUNDS = 1 if SMOKE else 200


def projection_shapes() -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of the `bench` model's matmuls."""
    c = named_config("bench")
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    return {
        "qkv": (q + 2 * kv, c.hidden_size),
        "o": (c.hidden_size, q),
        "gate_up": (2 * c.intermediate_size, c.hidden_size),
        "down": (c.hidden_size, c.intermediate_size),
        "lm_head": (c.vocab_size, c.hidden_size),
    }


SHAPES = projection_shapes()


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("impl", ["F.linear", "cpu_linear"])
def test_matmul(benchmark, impl, shape, rows):
    if impl == "cpu_linear" and cpu_linear.kernel() is None:
        pytest.skip("the C++ matmul kernel is not built here (see the log)")
    torch.set_num_threads(NUM_THREADS)
    out_features, in_features = SHAPES[shape]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, in_features, generator=g)
    weight = torch.randn(out_features, in_features, generator=g)
    if impl == "cpu_linear":
        packed = cpu_linear.PackedLinear(weight, None)

        def run():
            return packed(x)
    else:

        def run():
            return F.linear(x, weight)

    benchmark.group = f"matmul: {rows} rows"
    out = benchmark.pedantic(run, rounds=ROUNDS, iterations=1, warmup_rounds=5)
    assert out.shape == (rows, out_features)
    median = benchmark.stats.stats.median if benchmark.stats else None
    if median:
        benchmark.extra_info["gflops"] = round(2 * rows * in_features * out_features / median / 1e9)
