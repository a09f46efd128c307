"""The model's forward as the executor runs it: torch's ops (optionally under
`torch.compile`) or servelab's C++ CPU kernels (`kernel_forward`).

`Transformer` knows only torch's ops; which forward a step takes is chosen here,
once, from the device, `engine.cpu_kernels` and `engine.compile` (CUDA without
compile: `FusedForward`, the small ops fused in Triton). Every forward has the same
three calls (`forward`, `logits`, `argmax`) and computes the same numbers.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import torch

from servelab.errors import ConfigError
from servelab.executor.fused_forward import FusedForward
from servelab.executor.kernel_forward import KernelForward
from servelab.kernels import cpu_fused, cpu_linear, cpu_matmul
from servelab.kernels.cpp_extension import BUILD_PROBLEM
from servelab.model.transformer import Transformer

log = logging.getLogger(__name__)

CPU_KERNEL_CHOICES = ("auto", "on", "off")


class ModelForward(Protocol):
    cpu_kernels: bool  # whether the C++ CPU kernels run it

    def forward(self, input_ids, positions, kv_caches, backend, attn_plan) -> torch.Tensor: ...
    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...
    def argmax(self, logits: torch.Tensor) -> torch.Tensor: ...


class EagerAttention:
    """A backend whose `forward` `torch.compile` never traces: a backend's
    per-step plan (Python lists, loops over sequences) would force recompiles."""

    def __init__(self, backend: Any) -> None:
        self.forward = torch.compiler.disable(backend.forward)


class TorchForward:
    """The model's own torch ops; with `compile`, its forward under
    `torch.compile` (dynamic shapes: they change every step), attention eager."""

    cpu_kernels = False

    def __init__(self, model: Transformer, compile: bool = False) -> None:
        self.model = model
        self.compiled = torch.compile(model.forward, dynamic=True) if compile else None
        self._eager: tuple[Any, EagerAttention] | None = None

    def forward(self, input_ids, positions, kv_caches, backend, attn_plan) -> torch.Tensor:
        # the compiled code trusts the fused projections (it cannot trace the check):
        # a parameter replaced since fusing runs the eager model, which falls back
        if self.compiled is None or not self.model.fused_current():
            return self.model(input_ids, positions, kv_caches, backend, attn_plan)
        if self._eager is None or self._eager[0] is not backend:
            self._eager = (backend, EagerAttention(backend))
        return self.compiled(input_ids, positions, kv_caches, self._eager[1], attn_plan)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.argmax(dim=-1)  # ties to the lowest index, as the sampler's greedy rule


def cpu_kernel_problems(model: Transformer) -> list[str]:
    """Why the C++ CPU kernels cannot run `model` (empty: they can). bfloat16 and
    float16 weights run with float32 activations (`KernelForward`)."""
    reduced = model.dtype in cpu_matmul.REDUCED
    found = cpu_fused.problems(model.device, torch.float32 if reduced else model.dtype)
    # the fused kernels and servelab's matmul build together: SERVELAB_CPU_KERNEL=0 (or a
    # failed build) leaves torch's ops on every path, oneDNN's included
    if not found and cpu_linear.kernel() is None:
        found.append(BUILD_PROBLEM)
    return found


def choose_forward(model: Transformer, cpu_kernels: str, compile: bool) -> ModelForward:
    """The forward `engine.cpu_kernels` and `engine.compile` ask for: `auto` takes
    the C++ kernels wherever they can run, `on` is a ConfigError where they cannot
    (naming why). `compile=true` compiles torch's ops, so it keeps them off."""
    if cpu_kernels not in CPU_KERNEL_CHOICES:
        raise ConfigError(
            f"engine option cpu_kernels must be one of {', '.join(CPU_KERNEL_CHOICES)}, "
            f"got {cpu_kernels!r}"
        )
    if model.device.type == "cuda" and not compile and cpu_kernels != "on":
        return FusedForward(model)  # the layer's small ops fused: launches, not FLOPs, bound decode
    if cpu_kernels == "off":
        return TorchForward(model, compile)
    problems = cpu_kernel_problems(model)
    if compile:
        problems.append("engine.compile=true compiles the model's torch ops instead")
    if problems and cpu_kernels == "on":
        raise ConfigError(f"engine.cpu_kernels=on cannot run here: {'; '.join(problems)}")
    if problems:
        log.info("servelab: the C++ CPU kernels are off (%s)", "; ".join(problems))
        return TorchForward(model, compile)
    return KernelForward(model)
