"""Attention backends: the attention cost of one step on fixed batches — the
backend's `plan` (once per step) and its `forward` for every layer of the
`bench` model — for decode-only, prefill-only and mixed batches.

Shapes are the reference model's (4 query heads, 2 KV heads, head_dim 64, 4
layers), float32, 16-token blocks in shuffled order. `triton_paged` runs on
CUDA only (interpreted on a CPU it measures the interpreter).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from reference_workload import SMOKE, node_id, runs_on_this_machine, variants

from servelab.registry.construct import construct
from servelab.step.metadata import AttentionMetadata

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, NUM_LAYERS = 4, 2, 64, 4
BLOCK_SIZE = 16
DTYPE = torch.float32
ROUNDS = 1 if SMOKE else 20


def _lengths(seed: int, n: int, low: int, high: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, high + 1, (n,), generator=g).tolist()


def batches() -> dict[str, tuple[list[int], list[int]]]:
    """(query_lens, context_lens), decodes first: the reference workload's shapes
    (64 running sequences with 48..500 tokens; prompts of 32..256 tokens)."""
    scale = 8 if SMOKE else 1
    decode_ctx = _lengths(0, 64 // scale, 48, 500)
    prompts = _lengths(1, 8 // scale, 32, 256)
    return {
        "decode": ([1] * len(decode_ctx), decode_ctx),
        "prefill": (prompts, [0] * len(prompts)),
        "mixed": ([1] * (48 // scale) + prompts[:4], decode_ctx[: 48 // scale] + [0] * 4),
    }


@dataclass
class Step:
    meta: AttentionMetadata
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    caches: list[tuple[torch.Tensor, torch.Tensor]]


def make_step(query_lens: list[int], context_lens: list[int], device: torch.device) -> Step:
    seq_lens = [q + c for q, c in zip(query_lens, context_lens)]
    blocks_per_seq = [-(-s // BLOCK_SIZE) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 1
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(2)).tolist()
    tables, used = [], 0
    for n in blocks_per_seq:
        tables.append(order[used : used + n])
        used += n
    meta = AttentionMetadata.from_lists(query_lens, seq_lens, tables, BLOCK_SIZE, device=device)
    g = torch.Generator(device="cpu").manual_seed(3)
    tokens = meta.num_tokens

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=DTYPE).to(device)

    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    caches = [(rand(*shape), rand(*shape)) for _ in range(NUM_LAYERS)]
    return Step(
        meta,
        rand(tokens, NUM_HEADS, HEAD_DIM),
        rand(tokens, NUM_KV_HEADS, HEAD_DIM),
        rand(tokens, NUM_KV_HEADS, HEAD_DIM),
        caches,
    )


class FakeAllocator:
    block_size = BLOCK_SIZE
    num_blocks = 1
    name = "paged"


BATCHES = batches()


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("attention", variants("attention"), ids=node_id)
def test_attention_step(benchmark, attention, batch):
    reason = runs_on_this_machine(attention)
    if reason:
        pytest.skip(reason)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    backend = construct(
        "attention",
        attention,
        num_heads=NUM_HEADS,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        scale=HEAD_DIM**-0.5,
    )
    backend.check(FakeAllocator(), device, DTYPE)
    step = make_step(*BATCHES[batch], device)

    def run():
        plan = backend.plan(step.meta)
        for cache in step.caches:
            out = backend.forward(step.q, step.k, step.v, cache, plan)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return out

    benchmark.group = f"attention: {batch} step ({NUM_LAYERS} layers)"
    out = benchmark.pedantic(run, rounds=ROUNDS, iterations=1, warmup_rounds=1)
    assert out.shape == step.q.shape and torch.isfinite(out).all()
    benchmark.extra_info.update(
        num_seqs=step.meta.num_seqs, num_tokens=step.meta.num_tokens, device=device.type
    )
