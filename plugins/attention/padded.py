"""`padded`: the textbook batched attention. Every sequence's queries are padded
to the longest query and its keys to the longest context, so one masked SDPA
call over `[num_seqs, heads, max_query_len, max_seq_len]` serves the whole
batch. Simple and kernel-friendly, but a single long sequence makes every
other sequence pay for its length: `stats()` counts that waste.

Grouped-query heads are not copied: the `group` query heads that share a KV
head become `group * max_query_len` query rows of that head (the mask is
repeated per group), so SDPA reads each gathered key once per KV head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from servelab.contracts.attention import AttentionBackend
from servelab.contracts.hookspecs import hookimpl
from servelab.plugins.attention.padded_decode import padded_context_slots
from servelab.plugins.attention.per_request import Workspace, gather_slots, store_kv
from servelab.step.metadata import AttentionMetadata


@dataclass
class PaddedPlan:
    """Built once per step; every layer reuses it."""

    num_seqs: int
    max_query_len: int
    max_seq_len: int
    slot_mapping: torch.Tensor  # int64 [num_tokens]: where this step's K/V go
    token_to_row: torch.Tensor  # int64 [num_tokens]: packed token -> row i * max_query_len + j
    key_slots: torch.Tensor  # int64 [num_seqs * max_seq_len]: see padded_context_slots
    attn_mask: torch.Tensor  # bool [num_seqs, 1, group * max_query_len, max_seq_len], True = attend


class PaddedBackend(AttentionBackend):
    """Pads queries and keys to the batch maximum; one masked SDPA call per layer."""

    name: ClassVar[str] = "padded"
    description: ClassVar[str] = "pad every sequence to the longest, one masked SDPA call per layer"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        self.num_queries_per_kv = num_heads // num_kv_heads
        self.workspace = Workspace()
        self._stats = dict(
            planned_steps=0.0,
            real_query_tokens=0.0,
            padded_query_slots=0.0,
            real_key_tokens=0.0,
            padded_key_slots=0.0,
        )

    def plan(self, meta: AttentionMetadata) -> PaddedPlan:
        num_seqs, max_q, max_k = meta.num_seqs, meta.max_query_len, meta.max_seq_len
        device = meta.slot_mapping.device
        query_lens = meta.query_start_loc[1:] - meta.query_start_loc[:-1]
        context_lens = meta.context_lens.long()

        # packed token t of sequence i, query j -> padded row i * max_q + j
        seq_ids = torch.repeat_interleave(
            torch.arange(num_seqs, device=device), query_lens.long(), output_size=meta.num_tokens
        )
        query_index = (
            torch.arange(meta.num_tokens, device=device) - meta.query_start_loc[:-1].long()[seq_ids]
        )
        token_to_row = seq_ids * max_q + query_index

        key_slots, key_is_real = padded_context_slots(meta, num_seqs, max_k)
        # Query j of sequence i (position context_lens[i] + j) sees keys up to its
        # own position. A padding query row (j >= query_len) then sees every real
        # key, so no row is fully masked (that would give NaN); its output is dropped.
        key_pos = torch.arange(max_k, device=device)
        query_pos = context_lens.view(-1, 1, 1) + torch.arange(max_q, device=device).view(1, -1, 1)
        attn_mask = key_is_real.unsqueeze(1) & (key_pos.view(1, 1, -1) <= query_pos)
        attn_mask = attn_mask.repeat(1, self.num_queries_per_kv, 1)  # one copy per query head

        self._count_padding(meta)
        return PaddedPlan(
            num_seqs=num_seqs,
            max_query_len=max_q,
            max_seq_len=max_k,
            slot_mapping=meta.slot_mapping,
            token_to_row=token_to_row,
            key_slots=key_slots.view(-1),
            attn_mask=attn_mask.unsqueeze(1),
        )

    def _count_padding(self, meta: AttentionMetadata) -> None:
        real_keys = sum(meta.seq_lens_cpu)
        self._stats["planned_steps"] += 1
        self._stats["real_query_tokens"] += meta.num_tokens
        self._stats["padded_query_slots"] += meta.num_seqs * meta.max_query_len - meta.num_tokens
        self._stats["real_key_tokens"] += real_keys
        self._stats["padded_key_slots"] += meta.num_seqs * meta.max_seq_len - real_keys

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        plan: PaddedPlan,
    ) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        store_kv(k, v, k_cache, v_cache, plan.slot_mapping)
        num_seqs, max_q = plan.num_seqs, plan.max_query_len
        kv_heads, group, head_dim = self.num_kv_heads, self.num_queries_per_kv, self.head_dim

        # [num_seqs, max_q, kv_heads, group, dim] -> [num_seqs, kv_heads, group * max_q, dim]
        q_rows = q.new_zeros(num_seqs * max_q, self.num_heads, head_dim)
        q_rows.index_copy_(0, plan.token_to_row, q)
        q_padded = q_rows.view(num_seqs, max_q, kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
        q_padded = q_padded.reshape(num_seqs, kv_heads, group * max_q, head_dim)

        keys = self._gather(k_cache, plan, "k")
        values = self._gather(v_cache, plan, "v")
        out = F.scaled_dot_product_attention(
            q_padded, keys, values, attn_mask=plan.attn_mask, scale=self.scale
        )  # [num_seqs, kv_heads, group * max_q, dim]
        out = out.view(num_seqs, kv_heads, group, max_q, head_dim).permute(0, 3, 1, 2, 4)
        out_rows = out.reshape(num_seqs * max_q, self.num_heads, head_dim)
        return out_rows.index_select(0, plan.token_to_row)

    def _gather(self, cache: torch.Tensor, plan: PaddedPlan, name: str) -> torch.Tensor:
        """The padded keys (or values) as `[num_seqs, kv_heads, max_seq_len, head_dim]`:
        a key-major buffer, one whole slot (every KV head) per row, seen head-major.
        Gathering whole slots copies `kv_heads` times fewer, longer rows than a
        head-major gather; SDPA reads the strided view as it is."""
        shape = (plan.num_seqs, plan.max_seq_len, self.num_kv_heads, self.head_dim)
        out = self.workspace.take(name, shape, cache.dtype, cache.device)
        gather_slots(cache, plan.key_slots, out)
        return out.transpose(1, 2)

    def stats(self) -> dict[str, float]:
        """Cumulative over planned steps (not layers): real vs padding query and key slots."""
        return dict(self._stats)


@hookimpl
def servelab_register_attention_backends() -> dict[str, type[AttentionBackend]]:
    return {PaddedBackend.name: PaddedBackend}
