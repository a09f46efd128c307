"""The attention-backend contract: store a step's K/V and attend through the block table."""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, ClassVar

import torch

if TYPE_CHECKING:
    from servelab.contracts.allocator import KVAllocator
    from servelab.step.metadata import AttentionMetadata


class AttentionBackend(abc.ABC):
    """Computes attention for a packed batch of mixed prefill chunks and decodes.

    Rules:
    - `plan(meta)` runs once per step and returns whatever `forward` needs
      (masks, padding indices, kernel arguments); `forward` runs once per layer
      and must not rebuild per-step state;
    - `forward(q, k, v, kv_cache, plan)` first writes this step's `k`, `v`
      (`[num_tokens, num_kv_heads, head_dim]`) into the layer's cache at
      `meta.slot_mapping`, then attends every query (`[num_tokens, num_heads,
      head_dim]`) causally over its sequence's whole context — cached prefix,
      earlier chunks and this chunk — reading K/V through the block table; it
      returns `[num_tokens, num_heads, head_dim]`;
    - the layer cache is a pair `(k_cache, v_cache)`, each
      `[num_blocks, block_size, num_kv_heads, head_dim]`;
    - `check(...)` raises `ConfigError` naming the backend and the part it
      cannot serve.

    Engine-supplied context: `num_heads`, `num_kv_heads`, `head_dim`, `scale`.
    """

    description: ClassVar[str] = ""
    # True when forward() never syncs with the host and skips negative slots,
    # so a decode step can be captured in a CUDA graph (see servelab.executor.cuda_graphs)
    graph_safe: ClassVar[bool] = False

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    def check(self, allocator: KVAllocator, device: torch.device, dtype: torch.dtype) -> None:
        """Raises ConfigError for a combination this backend cannot serve."""

    @abc.abstractmethod
    def plan(self, meta: AttentionMetadata) -> Any:
        """Per-step preparation; the result is passed to every `forward` of the step."""

    @abc.abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        plan: Any,
    ) -> torch.Tensor:
        """Stores k/v into the cache, returns attention output for q."""

    def stats(self) -> dict[str, float]:
        """Backend-specific figures (e.g. padding tokens); cumulative."""
        return {}
