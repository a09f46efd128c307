"""Every decoder layer of one CPU step in a single C++ call.

Between `kernel_forward`'s per-layer kernel calls, Python glue shows at decode
sizes (and runs cache-cold, after each step's K/V stream). When the backend says
a step's attention is exactly the C++ paged kernel
(`kernel_forward.PagedKernelAttention`), `decoder_forward`
(`csrc/cpu_decoder.cpp`, which includes the three kernels' headers) runs the
whole loop, embedding lookup to final norm: the same kernel functions in the
same order on the same tensors, so the result is bit for bit the Python loop's.
It calls no module, so forward hooks do not run. Fallback: `cpp_extension`.
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


def layer_arguments(layers) -> tuple[list[torch.Tensor], list[int], list[float]]:
    """`KernelForward`'s layer programs flattened for `decoder_forward`."""
    empty = torch.empty(0)

    def given(t: torch.Tensor | None) -> torch.Tensor:  # an absent weight: empty
        return empty if t is None else t

    tensors: list[torch.Tensor] = []
    ints: list[int] = []
    eps: list[float] = []
    for layer in layers:
        tensors += [
            layer.attn_norm,
            layer.qkv.packed,
            given(layer.qkv.bias),
            given(layer.q_norm),
            given(layer.k_norm),
            layer.o.packed,
            given(layer.o.bias),
            layer.mlp_norm,
            layer.gate_up.packed,
            layer.down.packed,
            given(layer.down.bias),
        ]
        ints += [layer.qkv.out_features, layer.o.out_features, layer.gate_up.inner]
        ints += [layer.down.out_features]
        eps += [layer.attn_eps, layer.qk_eps, layer.mlp_eps]
    return tensors, ints, eps
