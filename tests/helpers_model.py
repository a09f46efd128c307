"""Test helpers for the model package: a dense reference attention backend and a
tiny paged-cache driver that runs prefill / decode steps through `Transformer`.

The backend follows the `AttentionBackend` contract in the plainest way: it
scatters this step's K/V at `slot_mapping`, then, per sequence, gathers the
whole context through the block table and runs causal SDPA with the query
offset `context_len`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from servelab.contracts.attention import AttentionBackend
from servelab.executor.forward import TorchForward
from servelab.step.metadata import AttentionMetadata


class DenseReferenceBackend(AttentionBackend):
    """One masked SDPA call per sequence over K/V gathered from the paged cache."""

    def plan(self, meta: AttentionMetadata) -> AttentionMetadata:
        return meta

    def forward(self, q, k, v, kv_cache, plan: Any) -> torch.Tensor:
        meta: AttentionMetadata = plan
        k_cache, v_cache = kv_cache
        flat_k = k_cache.view(-1, self.num_kv_heads, self.head_dim)
        flat_v = v_cache.view(-1, self.num_kv_heads, self.head_dim)
        flat_k[meta.slot_mapping] = k
        flat_v[meta.slot_mapping] = v

        out = torch.empty_like(q)
        group = self.num_heads // self.num_kv_heads
        start = 0
        for query_len, seq_len, table in zip(
            meta.query_lens_cpu, meta.seq_lens_cpu, meta.block_tables.tolist(), strict=True
        ):
            bs = meta.block_size
            slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(seq_len)])
            keys = flat_k[slots].repeat_interleave(group, dim=1)  # [S, H, D]
            values = flat_v[slots].repeat_interleave(group, dim=1)
            context_len = seq_len - query_len
            # query j sits at position context_len + j and sees keys 0..context_len + j
            query_pos = torch.arange(context_len, seq_len)[:, None]
            mask = torch.arange(seq_len)[None, :] <= query_pos  # [Q, S]
            queries = q[start : start + query_len]
            attn = F.scaled_dot_product_attention(
                queries.transpose(0, 1),
                keys.transpose(0, 1),
                values.transpose(0, 1),
                attn_mask=mask,
                scale=self.scale,
            )
            out[start : start + query_len] = attn.transpose(0, 1)
            start += query_len
        return out


def make_backend(config) -> DenseReferenceBackend:
    return DenseReferenceBackend(
        num_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        scale=config.attention_scale,
    )


class PagedDriver:
    """Runs a `Transformer` over sequences with a paged KV cache, like the engine
    would: each sequence owns blocks handed out in a scrambled order so the block
    table is really exercised. `forward` is the executor's forward to run it
    through (`TorchForward(model)` when None; a `KernelForward` for the C++ path);
    `backend` its attention backend (the dense reference when None)."""

    def __init__(
        self, model, num_blocks: int = 64, block_size: int = 4, forward=None, backend=None
    ) -> None:
        self.model = model
        self.forward = forward if forward is not None else TorchForward(model)
        self.block_size = block_size
        shape = model.kv_cache_shape(num_blocks, block_size)
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=model.dtype, device=model.device),
                torch.zeros(shape, dtype=model.dtype, device=model.device),
            )
            for _ in range(model.config.num_layers)
        ]
        # a fixed permutation: block tables are neither contiguous nor sorted
        self.free_blocks = torch.randperm(
            num_blocks, generator=torch.Generator().manual_seed(7)
        ).tolist()
        self.tables: dict[int, list[int]] = {}
        self.num_computed: dict[int, int] = {}
        self.backend = make_backend(model.config) if backend is None else backend

    def _grow(self, seq: int, num_tokens: int) -> list[int]:
        table = self.tables.setdefault(seq, [])
        while len(table) * self.block_size < num_tokens:
            table.append(self.free_blocks.pop())
        return table

    @torch.no_grad()
    def step(self, chunks: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
        """One packed step. `chunks` = [(seq id, new tokens)], decodes first.
        Returns, per chunk, the logits of every new token [len(tokens), vocab]."""
        query_lens, seq_lens, tables, ids = [], [], [], []
        for seq, tokens in chunks:
            start = self.num_computed.get(seq, 0)
            end = start + len(tokens)
            query_lens.append(len(tokens))
            seq_lens.append(end)
            tables.append(list(self._grow(seq, end)))
            ids += tokens
            self.num_computed[seq] = end
        meta = AttentionMetadata.from_lists(query_lens, seq_lens, tables, self.block_size)
        input_ids = torch.tensor(ids, device=self.model.device)
        hidden = self.forward.forward(
            input_ids,
            meta.positions.to(self.model.device),
            self.kv_caches,
            self.backend,
            self.backend.plan(meta),
        )
        logits = self.forward.logits(hidden)
        return list(logits.split(query_lens))
