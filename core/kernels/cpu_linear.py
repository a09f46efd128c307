"""A matmul for the CPU decode step's small batches, over weights packed once.

At a few rows MKL's `sgemm` repacks the weight on every call and splits tiny
work over threads; `csrc/cpu_linear.h` packs it once into panels and streams
each panel through a register-blocked micro-kernel. Contract: float32 or
float64 (the oracle's dtype, so its token-exact runs go through this kernel);
`x` [M, K] with contiguous rows; results match `F.linear` to rounding, not bit
for bit, and never depend on the thread count. `linear_gated` is SwiGLU in the
matmul's epilogue. Without a build, `kernel()` is None and callers keep
`F.linear` (the fallback rule is in `servelab.kernels.cpp_extension`).
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from servelab.kernels import huge_pages
from servelab.kernels.cpp_extension import build

DTYPES = (torch.float32, torch.float64)


@functools.cache
def kernel() -> ModuleType | None:
    """The compiled extension, or None (logged once) when it cannot be built."""
    return build(
        "servelab_cpu_linear",
        "cpu_linear.cpp",
        what="CPU packed-weight matmul",
        fallback="projections use F.linear",
    )


class PackedLinear:
    """`F.linear(x, weight, bias)` for a fixed weight, packed once.

    Holds its own packed copy: a weight changed in place afterwards is not
    seen (the model's `kernel_forward` repacks when a parameter changes)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        module = kernel()
        assert module is not None, "the CPU matmul kernel is not built: check kernel()"
        self._module = module
        self.out_features = weight.shape[0]
        # on huge pages: a decode step streams it
        self.packed = huge_pages.copy(module.pack_weight(weight.detach()))
        self.bias = None if bias is None else module.pack_bias(bias.detach(), self.packed.shape[0])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            lead = x.shape[:-1]
            out = self._module.linear(
                x.reshape(-1, x.shape[-1]), self.packed, self.bias, self.out_features
            )
            return out.view(*lead, self.out_features)
        return self._module.linear(x, self.packed, self.bias, self.out_features)
