"""`per_request`: the linear layers run batched, attention runs one SDPA call
per sequence over exactly its own context. No padding, but one kernel launch
per sequence per layer: the cost grows with the batch size, not its shape.

What each call reads is planned once per step: a fresh prompt attends over
this step's own K/V (no cache read), every other sequence over its context
gathered from the cache in one `index_select` per layer for the whole batch.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from servelab.contracts.attention import AttentionBackend
from servelab.contracts.hookspecs import hookimpl
from servelab.plugins.attention.common import Workspace, store_kv
from servelab.plugins.attention.sdpa_paths import PerSeqPlan, per_seq_attention, plan_per_seq
from servelab.step.metadata import AttentionMetadata


class PerRequestBackend(AttentionBackend):
    """One SDPA call per sequence over its own context."""

    name: ClassVar[str] = "per_request"
    description: ClassVar[str] = "one SDPA call per sequence over its own gathered context"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        self.num_queries_per_kv = num_heads // num_kv_heads
        self.workspace = Workspace()

    def plan(self, meta: AttentionMetadata) -> PerSeqPlan:
        return plan_per_seq(meta)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        plan: PerSeqPlan,
    ) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        store_kv(k, v, k_cache, v_cache, plan.slot_mapping)
        # out=None: a decode-only step returns its decodes' outputs as they come
        return per_seq_attention(q, k, v, k_cache, v_cache, plan, self.scale, None, self.workspace)


@hookimpl
def servelab_register_attention_backends() -> dict[str, type[AttentionBackend]]:
    return {PerRequestBackend.name: PerRequestBackend}
