"""The Triton KV-store and paged-attention kernels, and the `triton_paged`
backend, against a plain dense torch reference computed from unpaged K/V.

Without a GPU the kernels run under the Triton interpreter (the kernels module
sets TRITON_INTERPRET=1 itself when no CUDA device exists), which upcasts
16-bit inputs before its dots; the Qwen3 head shapes over ~1k contexts, in
every dtype, run only compiled on a CUDA device (benchmarks/gpu_kernels.sh).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

from servelab.errors import ConfigError
from servelab.plugins.attention import triton_kernels as tk
from servelab.plugins.attention.triton_paged import (
    TritonPagedBackend,
    servelab_register_attention_backends,
)
from servelab.step.metadata import AttentionMetadata

ON_GPU = torch.cuda.is_available() and not tk.INTERPRETED
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
cuda_only = pytest.mark.skipif(not ON_GPU, reason="needs compiled Triton kernels on a CUDA device")
pytestmark = [
    pytest.mark.gpu_path,
    pytest.mark.skipif(
        not (ON_GPU or tk.INTERPRETED),
        reason="Triton kernels compiled (TRITON_INTERPRET=0) and no CUDA device to run them on",
    ),
]

MAX_MODEL_LEN = 64
BATCHES = {  # name: (query_lens, context_lens), decodes first
    "decode": ([1, 1, 1], [5, 17, 40]),
    "prefill": ([7, 20], [0, 0]),
    "mixed": ([1, 1, 9, 13], [30, 3, 0, 21]),  # a chunk at offset 0 and one mid-context
}
TOLERANCE = {  # (absolute, relative): 16-bit outputs round to 2**-8 / 2**-11 of their size
    torch.float64: (1e-10, 0.0),
    torch.float32: (1e-4, 1e-4),
    torch.bfloat16: (1e-2, 2e-2),
    torch.float16: (2e-3, 4e-3),
}


# ---------------------------------------------------------------- reference


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context_len: int, scale):
    """One sequence, float64, no paging: q [Q, H, D] at positions context_len.., k/v [S, KVH, D]."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    query_pos = context_len + torch.arange(q.shape[0])
    hidden = torch.arange(k.shape[0])[None, :] > query_pos[:, None]
    probs = scores.masked_fill(hidden, float("-inf")).softmax(dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


@dataclass
class PagedCase:
    """A batch whose earlier context already sits in a paged cache (unused
    slots hold NaN, so reading one poisons the output) and whose new K/V
    (`k_new`, `v_new`) still has to be stored."""

    query_lens: list[int]
    context_lens: list[int]
    block_size: int
    block_tables: list[list[int]]
    q: torch.Tensor
    k_new: torch.Tensor
    v_new: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    scale: float

    @property
    def seq_lens(self) -> list[int]:
        return [c + q for c, q in zip(self.context_lens, self.query_lens)]

    def meta(self) -> AttentionMetadata:
        return AttentionMetadata.from_lists(
            self.query_lens, self.seq_lens, self.block_tables, self.block_size, device=DEVICE
        )

    def expected(self) -> torch.Tensor:
        starts = [0]
        for n in self.query_lens:
            starts.append(starts[-1] + n)
        return torch.cat(
            [
                dense_attention(self.q[a:b].cpu(), k.cpu(), v.cpu(), c, self.scale)
                for a, b, k, v, c in zip(
                    starts, starts[1:], self.keys, self.values, self.context_lens
                )
            ]
        )


def make_case(
    query_lens,
    context_lens,
    *,
    block_size=16,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    dtype=torch.float32,
    seed=0,
    layout_seed=0,
) -> PagedCase:
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3  # spare blocks that nobody may touch
    physical = random.Random(layout_seed).sample(range(num_blocks), num_blocks)  # shuffled ids
    tables, used = [], 0
    for n in blocks_per_seq:
        tables.append(physical[used : used + n])
        used += n

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype).to(DEVICE)

    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(cache_shape, float("nan"), dtype=dtype, device=DEVICE)
    v_cache = torch.full(cache_shape, float("nan"), dtype=dtype, device=DEVICE)
    keys = [rand(s, num_kv_heads, head_dim) for s in seq_lens]
    values = [rand(s, num_kv_heads, head_dim) for s in seq_lens]
    for table, c, k, v in zip(tables, context_lens, keys, values):
        for pos in range(c):  # the cached context, written without the kernel
            k_cache[table[pos // block_size], pos % block_size] = k[pos]
            v_cache[table[pos // block_size], pos % block_size] = v[pos]
    return PagedCase(
        query_lens=list(query_lens),
        context_lens=list(context_lens),
        block_size=block_size,
        block_tables=tables,
        q=rand(sum(query_lens), num_heads, head_dim),
        k_new=torch.cat([k[c:] for k, c in zip(keys, context_lens)]),
        v_new=torch.cat([v[c:] for v, c in zip(values, context_lens)]),
        k_cache=k_cache,
        v_cache=v_cache,
        keys=keys,
        values=values,
        scale=head_dim**-0.5,
    )


def run_kernels(case: PagedCase, tiles=None) -> torch.Tensor:
    meta = case.meta()
    tk.store_kv(case.k_new, case.v_new, case.k_cache, case.v_cache, meta.slot_mapping)
    return tk.paged_attention(
        case.q,
        case.k_cache,
        case.v_cache,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        meta.max_query_len,
        case.scale,
        tiles=tiles,
    )


def assert_close(out: torch.Tensor, case: PagedCase) -> None:
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    expected = case.expected()
    absolute, relative = TOLERANCE[case.q.dtype]
    excess = (out.cpu().double() - expected).abs() - relative * expected.abs()
    assert excess.max().item() <= absolute, f"max abs error beyond tolerance {excess.max().item()}"


# ---------------------------------------------------------------- attention kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", sorted(BATCHES))
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("block_size", [1, 16, MAX_MODEL_LEN])
def test_matches_dense_reference(block_size, group, batch, dtype):
    query_lens, context_lens = BATCHES[batch]
    case = make_case(
        query_lens, context_lens, block_size=block_size, num_heads=2 * group, dtype=dtype
    )
    assert_close(run_kernels(case), case)


@pytest.mark.parametrize(
    ("batch", "block_size"), [("decode", 16), ("prefill", 1), ("mixed", 16), ("mixed", 64)]
)
def test_float64_is_exact(batch, block_size):
    query_lens, context_lens = BATCHES[batch]
    case = make_case(
        query_lens, context_lens, block_size=block_size, head_dim=64, dtype=torch.float64
    )
    assert_close(run_kernels(case), case)


@pytest.mark.parametrize("head_dim", [128, 256])
def test_large_head_dims_in_float64(head_dim):
    # 128**-0.5 is not a float32 number: float64 must not round the scale to one.
    case = make_case([1, 5], [9, 4], block_size=4, head_dim=head_dim, dtype=torch.float64)
    assert_close(run_kernels(case), case)


@pytest.mark.parametrize("block_size", [1, 5, 16])
def test_small_tiles_rescale_across_key_tiles_and_split_queries(block_size):
    # block_m 16 with group 2 holds 8 query rows, so the 19- and 33-token chunks
    # span several query tiles, and 16-key tiles cross (unaligned) pages.
    case = make_case([1, 19, 33], [50, 0, 30], block_size=block_size, dtype=torch.float64)
    tiles = tk.AttentionTiles(block_m=16, block_n=16)
    assert_close(run_kernels(case, tiles=tiles), case)


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(6, 2), (3, 3), (12, 3)])
def test_group_and_head_counts_that_are_not_powers_of_two(num_heads, num_kv_heads):
    case = make_case([1, 6], [12, 3], num_heads=num_heads, num_kv_heads=num_kv_heads)
    assert_close(run_kernels(case), case)


@cuda_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("batch", ["decode", "mixed"])
def test_qwen3_head_shapes_on_gpu(batch, dtype):
    # Qwen3-0.6B: 16 query heads, 8 KV heads, head_dim 128, over ~1k contexts.
    query_lens = [1, 1, 1] if batch == "decode" else [1, 1, 300, 77]
    context_lens = [1000, 513, 64] if batch == "decode" else [900, 17, 0, 700]
    case = make_case(
        query_lens, context_lens, num_heads=16, num_kv_heads=8, head_dim=128, dtype=dtype
    )
    assert_close(run_kernels(case), case)


def test_empty_batch_returns_empty_output():
    case = make_case([1], [3])
    q = case.q[:0]
    meta = case.meta()
    no_seqs = dict(seq_lens=meta.seq_lens[:0], query_start_loc=meta.query_start_loc[:1])
    out = tk.paged_attention(
        q, case.k_cache, case.v_cache, meta.block_tables[:0], **no_seqs, max_query_len=0, scale=1.0
    )
    assert out.shape == q.shape


INTERPRETER_AFTER_TRITON_IMPORT = """
import triton.language  # as torch does lazily, before servelab decides on TRITON_INTERPRET
import torch
import torch.nn.functional as F
from servelab.step.metadata import AttentionMetadata
from servelab.plugins.attention import triton_kernels as tk
assert tk.INTERPRETED
q, k, v = torch.randn(3, 5, 4, 16, dtype=torch.float64).unbind(0)
k_cache, v_cache = torch.zeros(2, 3, 2, 4, 16, dtype=torch.float64).unbind(0)  # 3 blocks of 2
meta = AttentionMetadata.from_lists([5], [5], [[2, 0, 1]], block_size=2)
tk.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
out = tk.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                         meta.query_start_loc, 5, 0.25)
ref = F.scaled_dot_product_attention(*(t.transpose(0, 1) for t in (q, k, v)), is_causal=True,
                                     scale=0.25).transpose(0, 1)
print((out - ref).abs().max().item())
"""


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="the interpreter fallback is for CPU-only machines"
)
def test_interpreter_works_when_triton_language_was_imported_first():
    # An engine run imports torch internals that import triton.language before
    # this backend loads; the kernels must still run interpreted.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", INTERPRETER_AFTER_TRITON_IMPORT],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert float(result.stdout.split()[-1]) < 1e-10


# ---------------------------------------------------------------- KV store


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_kv_heads", "head_dim", "block_size"), [(2, 16, 1), (3, 64, 16)])
def test_store_kv_writes_exactly_its_slots(num_kv_heads, head_dim, block_size, dtype):
    gen = torch.Generator().manual_seed(1)
    num_tokens = 70
    num_blocks = -(-(num_tokens + 30) // block_size)  # 30 slots stay free
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    v_cache = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::7] = -1  # skipped tokens (padding)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    for token, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected_k[slot // block_size, slot % block_size] = k[token]
            expected_v[slot // block_size, slot % block_size] = v[token]

    tk.store_kv(k, v, k_cache, v_cache, slots.to(DEVICE))

    assert torch.equal(k_cache, expected_k)
    assert torch.equal(v_cache, expected_v)


def test_store_kv_reads_strided_inputs():
    # q/k/v usually come out of one fused projection: views, not contiguous tensors.
    qkv = torch.randn(5, 3, 2, 16, device=DEVICE)
    k, v = qkv[:, 1], qkv[:, 2]
    k_cache = torch.zeros(4, 2, 2, 16, device=DEVICE)
    v_cache = torch.zeros(4, 2, 2, 16, device=DEVICE)
    slots = torch.tensor([7, 0, 3, 4, 2], device=DEVICE)
    tk.store_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache.view(-1, 2, 16)[slots], k)
    assert torch.equal(v_cache.view(-1, 2, 16)[slots], v)


# ---------------------------------------------------------------- backend API


def make_backend(num_heads=4, num_kv_heads=2, head_dim=16) -> TritonPagedBackend:
    return TritonPagedBackend(
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, scale=head_dim**-0.5
    )


def test_backend_forward_matches_reference_on_two_layers():
    backend = make_backend()
    # Same batch layout (block tables), different values: two layers of one step.
    layers = [make_case(*BATCHES["mixed"], block_size=4, seed=s) for s in (1, 2)]
    plan = backend.plan(layers[0].meta())  # one plan per step, shared by every layer
    for case in layers:
        out = backend.forward(case.q, case.k_new, case.v_new, (case.k_cache, case.v_cache), plan)
        assert_close(out, case)


def test_backend_check_accepts_supported_configurations():
    backend = make_backend()
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        backend.check(None, DEVICE, dtype)


@pytest.mark.parametrize(
    ("backend", "device", "dtype", "words"),
    [
        (make_backend(head_dim=96), "cpu", torch.float32, ["head_dim", "96"]),
        (make_backend(head_dim=512), "cpu", torch.float32, ["head_dim", "512"]),
        (make_backend(head_dim=8), "cpu", torch.float32, ["head_dim", "8"]),
        (make_backend(num_heads=5), "cpu", torch.float32, ["num_kv_heads", "5"]),
        (make_backend(), "cpu", torch.int8, ["dtype", "int8"]),
        (make_backend(), "meta", torch.float32, ["device", "meta"]),
    ],
)
def test_backend_check_names_what_it_cannot_serve(backend, device, dtype, words):
    with pytest.raises(ConfigError) as error:
        backend.check(None, torch.device(device), dtype)
    for word in ["triton_paged", *words]:
        assert word in str(error.value)


def test_backend_is_registered_with_a_description():
    assert servelab_register_attention_backends() == {"triton_paged": TritonPagedBackend}
    assert TritonPagedBackend.description
