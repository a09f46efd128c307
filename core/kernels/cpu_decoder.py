"""Every decoder layer of one CPU step in a single C++ call.

Between `kernel_forward`'s per-layer kernel calls, Python glue shows at decode
sizes (and runs cache-cold, after each step's K/V stream). When the backend says
a step's attention is exactly the C++ paged kernel
(`kernel_forward.PagedKernelAttention`), `decoder_forward`
(`csrc/cpu_decoder.cpp`, which includes the three kernels' headers) runs the
whole loop, embedding lookup to final norm: the same kernel functions in the
same order on the same tensors, so the result is bit for bit the Python loop's.
It runs servelab's packed float32 / float64 weights at any number of tokens, and
bfloat16 weights at one token through the bf16 row kernel (a batch-1 decode step,
where the Python loop's few milliseconds showed beside the weights' stream). It
calls no module, so forward hooks do not run. Fallback: `cpp_extension`.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from servelab.kernels.cpp_extension import build

# One layer's tensors in the order the loop reads them; an absent optional
# weight (a bias, Qwen3's q/k norms on other models) is an empty tensor.
LAYER_TENSORS = (
    "attn_norm",
    "qkv_packed",
    "qkv_bias",
    "q_norm",
    "k_norm",
    "o_packed",
    "o_bias",
    "mlp_norm",
    "gate_up_packed",
    "down_packed",
    "down_bias",
)
LAYER_INTS = ("qkv_out", "o_out", "inner", "down_out")
LAYER_EPS = ("attn_eps", "qk_eps", "mlp_eps")


@functools.cache
def kernel() -> ModuleType | None:
    """The compiled extension, or None (logged once) when it cannot be built."""
    return build(
        "servelab_cpu_decoder",
        "cpu_decoder.cpp",
        what="CPU decoder loop",
        fallback="the model's layers run one kernel call at a time from Python",
    )


def layer_arguments(layers, bf16_rows: bool) -> tuple[list[torch.Tensor], list[int], list[float]]:
    """`KernelForward`'s layer programs flattened for `decoder_forward`: servelab's
    packed weights, or (`bf16_rows`) the bfloat16 weights `PackedMatmul`s hold."""
    empty = torch.empty(0)

    def weight(matmul) -> torch.Tensor:
        return matmul.weight if bf16_rows else matmul.packed

    def given(t: torch.Tensor | None) -> torch.Tensor:  # an absent weight: empty
        return empty if t is None else t

    tensors: list[torch.Tensor] = []
    ints: list[int] = []
    eps: list[float] = []
    for layer in layers:
        tensors += [
            layer.attn_norm,
            weight(layer.qkv),
            given(layer.qkv.bias),
            given(layer.q_norm),
            given(layer.k_norm),
            weight(layer.o),
            given(layer.o.bias),
            layer.mlp_norm,
            weight(layer.gate_up),
            weight(layer.down),
            given(layer.down.bias),
        ]
        inner = layer.gate_up.out_features // 2 if bf16_rows else layer.gate_up.inner
        ints += [layer.qkv.out_features, layer.o.out_features, inner]
        ints += [layer.down.out_features]
        eps += [layer.attn_eps, layer.qk_eps, layer.mlp_eps]
    return tensors, ints, eps
