"""`per_request`: the linear layers run batched, attention runs one SDPA call
per sequence over exactly its own context. No padding, but one kernel launch
per sequence per layer: the cost grows with the batch size, not its shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from servelab.batch import AttentionMetadata
from servelab.hookspecs import hookimpl
from servelab.interfaces import AttentionBackend
from servelab.plugins.attention.common import (
    causal_offset_mask,
    expand_kv_heads,
    flat_cache,
    packed_context_slots,
    store_kv,
)


@dataclass
class SeqSlice:
    """Where one sequence's queries and keys sit in the packed tensors, and how it masks."""

    query_start: int
    query_end: int
    key_start: int
    key_end: int
    attn_mask: torch.Tensor | None  # bool [query_len, seq_len]; None with is_causal or a decode
    is_causal: bool  # a whole prompt from position 0: SDPA's own (square) causal mask


@dataclass
class PerRequestPlan:
    """Built once per step; every layer reuses it."""

    slot_mapping: torch.Tensor  # int64 [num_tokens]
    context_slots: torch.Tensor  # int64 [sum(seq_lens)]: every context, packed by seq_start_loc
    seqs: list[SeqSlice]


class PerRequestBackend(AttentionBackend):
    """One SDPA call per sequence over its gathered context."""

    name: ClassVar[str] = "per_request"
    description: ClassVar[str] = "one SDPA call per sequence over its own gathered context"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        self.num_queries_per_kv = num_heads // num_kv_heads

    def plan(self, meta: AttentionMetadata) -> PerRequestPlan:
        device = meta.slot_mapping.device
        seqs: list[SeqSlice] = []
        query_start = key_start = 0
        for query_len, seq_len in zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True):
            context_len = seq_len - query_len
            # SDPA's is_causal aligns the diagonal top-left, which is only right
            # when queries and keys start together; a chunk after a cached prefix
            # needs the offset mask. A single query sees every key: no mask.
            is_causal = context_len == 0 and query_len > 1
            needs_mask = context_len > 0 and query_len > 1
            seqs.append(
                SeqSlice(
                    query_start=query_start,
                    query_end=query_start + query_len,
                    key_start=key_start,
                    key_end=key_start + seq_len,
                    attn_mask=causal_offset_mask(context_len, query_len, device)
                    if needs_mask
                    else None,
                    is_causal=is_causal,
                )
            )
            query_start += query_len
            key_start += seq_len
        return PerRequestPlan(
            slot_mapping=meta.slot_mapping, context_slots=packed_context_slots(meta), seqs=seqs
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        plan: PerRequestPlan,
    ) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        store_kv(k, v, k_cache, v_cache, plan.slot_mapping)
        # one gather per layer for all sequences, then views per sequence
        keys = flat_cache(k_cache)[plan.context_slots].transpose(0, 1)  # [kv_heads, keys, dim]
        values = flat_cache(v_cache)[plan.context_slots].transpose(0, 1)
        out = torch.empty_like(q)
        for s in plan.seqs:
            seq_keys = expand_kv_heads(keys[:, s.key_start : s.key_end], self.num_queries_per_kv, 0)
            seq_values = expand_kv_heads(
                values[:, s.key_start : s.key_end], self.num_queries_per_kv, 0
            )
            seq_out = F.scaled_dot_product_attention(
                q[s.query_start : s.query_end].transpose(0, 1),  # [heads, query_len, dim]
                seq_keys,
                seq_values,
                attn_mask=s.attn_mask,
                is_causal=s.is_causal,
                scale=self.scale,
            )
            out[s.query_start : s.query_end] = seq_out.transpose(0, 1)
        return out


@hookimpl
def servelab_register_attention_backends() -> dict[str, type[AttentionBackend]]:
    return {PerRequestBackend.name: PerRequestBackend}
