"""The torch attention backends against a naive float64 reference.

Every backend must store the step's K/V at its slots and attend each query
causally over its sequence's whole context, for decode-only, prefill-only and
mixed batches, chunks after a cached prefix, GQA, any block size and any
physical block order. flash_varlen's `sdpa` and `cpu` impls are also run at
real head sizes against its `reference` impl, asserting which path ran
(the C++ kernel itself is tested in `test_cpu_kernel.py`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import pytest
import torch

from servelab.contracts.attention import AttentionBackend
from servelab.errors import ConfigError
from servelab.kernels import cpu_paged
from servelab.plugins.attention import flash_varlen, padded, per_request, varlen_impls
from servelab.plugins.attention.flash_varlen import FlashVarlenBackend, varlen_attention_reference
from servelab.plugins.attention.padded import PaddedBackend
from servelab.plugins.attention.per_request import PerRequestBackend
from servelab.step.metadata import AttentionMetadata
from tests.attention_reference import (
    make_paged_case,
    naive_causal_attention,
    write_positions,
)

NUM_HEADS = 4
HEAD_DIM = 8
ONE_BLOCK = 40  # > every sequence here: the contiguous layout, one block per sequence

BACKENDS = {
    "padded": lambda **ctx: PaddedBackend(**ctx),
    "per_request": lambda **ctx: PerRequestBackend(**ctx),
    "flash_varlen-reference": lambda **ctx: FlashVarlenBackend(**ctx, impl="reference"),
    "flash_varlen-auto": lambda **ctx: FlashVarlenBackend(**ctx, impl="auto"),
    "flash_varlen-sdpa": lambda **ctx: FlashVarlenBackend(**ctx, impl="sdpa"),
    # at HEAD_DIM 8 the C++ kernel cannot serve: this runs impl=cpu's SDPA fallback
    "flash_varlen-cpu": lambda **ctx: FlashVarlenBackend(**ctx, impl="cpu"),
}

# (query_lens, context_lens), decodes first as the engine orders them
BATCHES = {
    "decode_only": ([1, 1, 1], [4, 17, 33]),
    "prefill_only": ([7, 12, 3], [0, 0, 0]),
    "mixed": ([1, 1, 6, 5], [9, 20, 0, 11]),
    "chunks_mid_context": ([8, 4, 9], [13, 16, 3]),
    "single_token_prompt": ([1, 1], [0, 5]),
    # decodes, a one-token prompt among them, a chunk, a one-token chunk after it
    "one_query_rows_of_every_kind": ([1, 1, 1, 4, 1], [6, 0, 9, 3, 12]),
}

TOLERANCE = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.float64: dict(atol=1e-10, rtol=1e-10)}


@dataclass
class FakeAllocator:
    block_size: int
    num_blocks: int = 8
    name: str = "paged"


def make_backend(backend_id: str, num_kv_heads: int, dtype=torch.float32, block_size=16):
    backend = BACKENDS[backend_id](
        num_heads=NUM_HEADS, num_kv_heads=num_kv_heads, head_dim=HEAD_DIM, scale=HEAD_DIM**-0.5
    )
    backend.check(FakeAllocator(block_size), torch.device("cpu"), dtype)
    return backend


def run_step(backend: AttentionBackend, case) -> torch.Tensor:
    plan = backend.plan(case.meta())
    return backend.forward(case.q, case.k_new, case.v_new, (case.k_cache, case.v_cache), plan)


def assert_matches_reference(out: torch.Tensor, case, dtype: torch.dtype) -> None:
    expected = naive_causal_attention(case.q, case.keys, case.values, case.query_lens, case.scale)
    assert out.shape == case.q.shape and out.dtype == dtype
    torch.testing.assert_close(out.double(), expected, **TOLERANCE[dtype])


def assert_cache_written(case, expected_caches) -> None:
    k_expected, v_expected = expected_caches
    # exact: the step's K/V at their slots, every other slot (NaN fill included) untouched
    torch.testing.assert_close(case.k_cache, k_expected, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(case.v_cache, v_expected, rtol=0, atol=0, equal_nan=True)


# -- correctness


@pytest.mark.parametrize("block_size", [1, 16, ONE_BLOCK])
@pytest.mark.parametrize("num_kv_heads", [4, 2, 1], ids=["gqa1", "gqa2", "gqa4"])
@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("backend_id", list(BACKENDS))
def test_matches_reference_and_stores_kv(backend_id, batch, num_kv_heads, block_size):
    query_lens, context_lens = BATCHES[batch]
    case = make_paged_case(
        query_lens, context_lens, num_heads=NUM_HEADS, num_kv_heads=num_kv_heads,
        head_dim=HEAD_DIM, block_size=block_size, seed=block_size + num_kv_heads,
    )  # fmt: skip
    expected_caches = case.expected_caches()
    out = run_step(make_backend(backend_id, num_kv_heads, block_size=block_size), case)
    assert_matches_reference(out, case, torch.float32)
    assert_cache_written(case, expected_caches)


@pytest.mark.parametrize("shuffle_blocks", [True, False], ids=["shuffled", "in_order"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("backend_id", list(BACKENDS))
def test_dtypes_and_block_order(backend_id, dtype, shuffle_blocks):
    case = make_paged_case(
        [1, 1, 6, 5], [9, 20, 0, 11], num_heads=NUM_HEADS, num_kv_heads=2, head_dim=HEAD_DIM,
        block_size=4, dtype=dtype, shuffle_blocks=shuffle_blocks, seed=7,
    )  # fmt: skip
    expected_caches = case.expected_caches()
    out = run_step(make_backend(backend_id, 2, dtype=dtype, block_size=4), case)
    assert_matches_reference(out, case, dtype)
    assert_cache_written(case, expected_caches)


@pytest.mark.parametrize("backend_id", list(BACKENDS))
def test_one_plan_serves_every_layer(backend_id):
    """plan() is per step: two layers (two caches, two K/V sets) reuse one plan."""
    layers = [
        make_paged_case([1, 7], [10, 5], num_heads=NUM_HEADS, num_kv_heads=2, head_dim=HEAD_DIM,
                        block_size=4, shuffle_blocks=False, seed=seed)
        for seed in (1, 2)
    ]  # fmt: skip
    backend = make_backend(backend_id, 2, block_size=4)
    plan = backend.plan(layers[0].meta())  # both cases share lengths and block tables
    assert layers[0].block_tables == layers[1].block_tables
    for case in layers:
        out = backend.forward(case.q, case.k_new, case.v_new, (case.k_cache, case.v_cache), plan)
        assert_matches_reference(out, case, torch.float32)


@pytest.mark.parametrize("backend_id", list(BACKENDS))
def test_chunked_prefill_then_decode_through_own_cache(backend_id):
    """Three steps where each step reads what the backend itself stored before:
    A's prompt in two chunks, B's whole prompt, then decodes (decodes first)."""
    gen = torch.Generator().manual_seed(3)
    block_size, num_kv_heads = 4, 2
    total = {"A": 15, "B": 8}
    keys = {s: torch.randn(n, num_kv_heads, HEAD_DIM, generator=gen) for s, n in total.items()}
    values = {s: torch.randn(n, num_kv_heads, HEAD_DIM, generator=gen) for s, n in total.items()}
    tables = {"A": [5, 0, 7, 2], "B": [6, 3]}
    k_cache = torch.full((9, block_size, num_kv_heads, HEAD_DIM), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    steps = [  # (sequence, first position, end position), batch order
        [("A", 0, 9), ("B", 0, 7)],
        [("B", 7, 8), ("A", 9, 14)],
        [("A", 14, 15)],
    ]
    backend = make_backend(backend_id, num_kv_heads, block_size=block_size)
    for step in steps:
        query_lens = [end - start for _, start, end in step]
        seq_lens = [end for _, _, end in step]
        meta = AttentionMetadata.from_lists(
            query_lens, seq_lens, [tables[s] for s, _, _ in step], block_size
        )
        q = torch.randn(sum(query_lens), NUM_HEADS, HEAD_DIM, generator=gen)
        k_new = torch.cat([keys[s][a:b] for s, a, b in step])
        v_new = torch.cat([values[s][a:b] for s, a, b in step])
        out = backend.forward(q, k_new, v_new, (k_cache, v_cache), backend.plan(meta))
        expected = naive_causal_attention(
            q, [keys[s][:b] for s, _, b in step], [values[s][:b] for s, _, b in step],
            query_lens, HEAD_DIM**-0.5,
        )  # fmt: skip
        torch.testing.assert_close(out.double(), expected, **TOLERANCE[torch.float32])


# -- flash_varlen's fast CPU impls at real head sizes, against its reference impl

# (query_lens, context_lens): decodes whose contexts end mid-tile, on a tile
# boundary (the kernel scores 16 float32 / 8 float64 keys at a time) and past
# several tiles, next to prompts and chunks
FAST_BATCHES = {
    "decode": ([1, 1, 1, 1, 1], [0, 15, 16, 40, 95]),
    "prefill": ([7, 19], [0, 0]),
    "mixed": ([1, 1, 1, 6, 9], [8, 31, 70, 0, 13]),
    # chunks of SDPA_PROMPT_TOKENS or more: impl=cpu's kernel takes the decodes only
    "mixed-long": ([1, 1, 17, 24], [8, 31, 5, 0]),
}
# (num_heads, num_kv_heads): no grouping, groups of 2 and 8, and of 3 (not a power of two)
HEAD_LAYOUTS = [(4, 4), (4, 2), (8, 1), (6, 2)]


def run_impl(impl, case, num_heads, num_kv_heads, head_dim, dtype):
    """One step of flash_varlen with `impl` on a copy of `case`'s cache: (output, backend)."""
    backend = FlashVarlenBackend(num_heads, num_kv_heads, head_dim, case.scale, impl=impl)
    backend.check(FakeAllocator(case.block_size), torch.device("cpu"), dtype)
    caches = (case.k_cache.clone(), case.v_cache.clone())
    plan = backend.plan(case.meta())
    return backend.forward(case.q, case.k_new, case.v_new, caches, plan), backend


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("heads", HEAD_LAYOUTS, ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("batch", list(FAST_BATCHES))
@pytest.mark.parametrize("impl", ["sdpa", "cpu"])
def test_fast_impls_match_the_reference_impl(impl, batch, head_dim, heads, block_size, dtype):
    num_heads, num_kv_heads = heads
    query_lens, context_lens = FAST_BATCHES[batch]
    case = make_paged_case(
        query_lens, context_lens, num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, block_size=block_size, dtype=dtype, seed=head_dim + block_size,
    )  # fmt: skip
    expected_caches = case.expected_caches()
    want, _ = run_impl("reference", case, num_heads, num_kv_heads, head_dim, dtype)
    backend = FlashVarlenBackend(num_heads, num_kv_heads, head_dim, case.scale, impl=impl)
    backend.check(FakeAllocator(block_size), torch.device("cpu"), dtype)
    out = run_step(backend, case)
    assert out.shape == case.q.shape and out.dtype == dtype
    torch.testing.assert_close(out, want, **TOLERANCE[dtype])
    assert_matches_reference(out, case, dtype)  # and the independent naive one
    assert_cache_written(case, expected_caches)
    # the path that ran: the C++ kernel for every impl=cpu step (short prompt chunks
    # too, each token as one query over its causal context; with a chunk of
    # SDPA_PROMPT_TOKENS or more, for the decodes only), never for sdpa
    long_chunk = max(query_lens) >= flash_varlen.SDPA_PROMPT_TOKENS
    decodes = query_lens[0] == 1 and context_lens[0] > 0
    kernel_calls = 1 if impl == "cpu" and (decodes or not long_chunk) else 0
    assert backend.stats() == {"cpu_kernel_calls": kernel_calls, "cpu_prompt_kernel_calls": 0}


def test_cpu_impl_falls_back_to_sdpa_without_the_kernel(monkeypatch, caplog):
    """No kernel (SERVELAB_CPU_KERNEL=0): impl=cpu logs why and runs SDPA's
    batched decode, with the same results."""
    monkeypatch.setenv("SERVELAB_CPU_KERNEL", "0")
    cpu_paged.kernel.cache_clear()
    try:
        case = make_paged_case([1, 1, 5], [17, 3, 6], num_kv_heads=2, head_dim=64, seed=21)
        with caplog.at_level(logging.INFO, logger=flash_varlen.__name__):
            out, backend = run_impl("cpu", case, 4, 2, 64, torch.float32)
        assert backend.active_impl == "cpu" and backend.stats()["cpu_kernel_calls"] == 0
        assert "SERVELAB_CPU_KERNEL=0" in caplog.text and "SDPA" in caplog.text
        assert_matches_reference(out, case, torch.float32)
    finally:
        cpu_paged.kernel.cache_clear()  # later tests build (load) the kernel again


def test_cpu_impl_counts_one_kernel_call_per_layer():
    """One plan, three layers: three kernel calls, each on its own cache."""
    layers = [
        make_paged_case([1, 1, 4], [20, 7, 2], head_dim=64, shuffle_blocks=False, seed=seed)
        for seed in (1, 2, 3)
    ]
    backend = FlashVarlenBackend(4, 2, 64, layers[0].scale, impl="cpu")
    backend.check(FakeAllocator(16), torch.device("cpu"), torch.float32)
    plan = backend.plan(layers[0].meta())
    for case in layers:
        out = backend.forward(case.q, case.k_new, case.v_new, (case.k_cache, case.v_cache), plan)
        assert_matches_reference(out, case, torch.float32)
    assert backend.stats()["cpu_kernel_calls"] == len(layers)


# -- the paged-cache helpers the backends share (per_request's, varlen_impls')


def gather_kv(k_cache, v_cache, block_table_row, seq_len):
    """One sequence's first `seq_len` keys and values, read through its block table row."""
    positions = torch.arange(seq_len)
    slots = per_request.context_slots(block_table_row.unsqueeze(0), 0, positions, k_cache.shape[1])
    return per_request.flat_cache(k_cache)[slots], per_request.flat_cache(v_cache)[slots]


def test_store_and_gather_round_trip():
    case = make_paged_case([3, 5], [6, 0], block_size=4, seed=11)
    meta = case.meta()
    per_request.store_kv(case.k_new, case.v_new, case.k_cache, case.v_cache, meta.slot_mapping)
    for i, seq_len in enumerate(case.seq_lens):
        k, v = gather_kv(case.k_cache, case.v_cache, meta.block_tables[i], seq_len)
        torch.testing.assert_close(k, case.keys[i], rtol=0, atol=0)
        torch.testing.assert_close(v, case.values[i], rtol=0, atol=0)
    packed = per_request.flat_cache(case.k_cache)[varlen_impls.packed_context_slots(meta)]
    torch.testing.assert_close(packed, torch.cat(case.keys), rtol=0, atol=0)


def test_expand_kv_heads_maps_query_head_to_its_group():
    kv = torch.arange(3).view(1, 3, 1).float()  # three KV heads, values 0, 1, 2
    expanded = per_request.expand_kv_heads(kv, 2, dim=1)
    assert expanded.flatten().tolist() == [h // 2 for h in range(6)]


def test_causal_offset_mask_aligns_bottom_right():
    mask = per_request.causal_offset_mask(context_len=3, query_len=2, device=torch.device("cpu"))
    for j in range(2):
        for key in range(5):
            assert bool(mask[j, key]) == (key <= 3 + j)


# -- flash_varlen's reference of the FlashAttention contract


def test_varlen_reference_takes_seqused_k_and_zeroes_keyless_rows():
    case = make_paged_case([2, 3], [4, 0], block_size=4, fill=0.0, seed=5)
    meta = case.meta()
    per_request.store_kv(case.k_new, case.v_new, case.k_cache, case.v_cache, meta.slot_mapping)
    args = (case.q, case.k_cache, case.v_cache, meta.query_start_loc)
    via_cu = varlen_attention_reference(
        *args,
        meta.seq_start_loc,
        meta.block_tables,
        meta.max_query_len,
        meta.max_seq_len,
        case.scale,
    )
    via_used = varlen_attention_reference(
        *args, None, meta.block_tables, meta.max_query_len, meta.max_seq_len, case.scale,
        seqused_k=meta.seq_lens,
    )  # fmt: skip
    expected = naive_causal_attention(case.q, case.keys, case.values, case.query_lens, case.scale)
    torch.testing.assert_close(via_cu.double(), expected, **TOLERANCE[torch.float32])
    torch.testing.assert_close(via_used, via_cu, rtol=0, atol=0)
    # 3 queries over 2 keys, bottom-right: the first query sees no key -> zeros
    q = torch.randn(3, NUM_HEADS, HEAD_DIM)
    cu_q, cu_k = torch.tensor([0, 3], dtype=torch.int32), torch.tensor([0, 2], dtype=torch.int32)
    out = varlen_attention_reference(
        q, case.k_cache, case.v_cache, cu_q, cu_k, meta.block_tables[1:], 3, 2, case.scale
    )
    assert torch.count_nonzero(out[0]) == 0 and torch.count_nonzero(out[1:]) > 0


# -- check(), impl selection


def test_flash_attn_impl_on_cpu_names_every_broken_constraint():
    backend = FlashVarlenBackend(NUM_HEADS, 2, HEAD_DIM, 1.0, impl="flash_attn")
    with pytest.raises(ConfigError) as info:
        backend.check(FakeAllocator(block_size=16), torch.device("cpu"), torch.float32)
    message = str(info.value)
    assert "flash_varlen" in message and "flash_attn" in message
    assert "CUDA" in message and "got cpu" in message
    assert "float16 or bfloat16" in message and "torch.float32" in message
    assert "multiple of 256" in message and "block_size=16" in message
    assert "'paged'" in message


def test_torch_impl_on_cpu_is_a_config_error():
    backend = FlashVarlenBackend(NUM_HEADS, 2, HEAD_DIM, 1.0, impl="torch")
    with pytest.raises(ConfigError, match=r"impl='torch'.*CUDA \(got cpu\)"):
        backend.check(FakeAllocator(block_size=256), torch.device("cpu"), torch.float16)


def test_unknown_impl_lists_the_choices():
    with pytest.raises(ConfigError, match="auto, flash_attn, torch, reference, sdpa, cpu"):
        FlashVarlenBackend(NUM_HEADS, 2, HEAD_DIM, 1.0, impl="triton")


@pytest.mark.parametrize(
    ("head_dim", "dtype", "chosen", "passed_over"),
    [
        (64, torch.float32, "cpu", []),
        (128, torch.float64, "cpu", []),
        (64, torch.bfloat16, "cpu", []),
        (64, torch.float16, "sdpa", ["not cpu", "float32 or float64 or bfloat16"]),
        (HEAD_DIM, torch.float32, "sdpa", ["not cpu", "head_dim"]),
    ],
)
def test_auto_on_cpu_picks_the_fastest_usable_impl_and_logs_it(
    caplog, head_dim, dtype, chosen, passed_over
):
    """On a CPU: the C++ kernel where it serves, else SDPA; never the reference."""
    backend = FlashVarlenBackend(NUM_HEADS, 2, head_dim, 1.0, impl="auto")
    with caplog.at_level(logging.INFO, logger=flash_varlen.__name__):
        backend.check(FakeAllocator(block_size=16), torch.device("cpu"), dtype)
    assert backend.active_impl == chosen
    assert f"chose '{chosen}'" in caplog.text and "not flash_attn" in caplog.text
    for reason in passed_over:
        assert reason in caplog.text


@pytest.mark.parametrize(("head_dim", "chosen"), [(HEAD_DIM, "sdpa"), (64, "cpu")])
def test_auto_without_check_decides_on_first_forward(head_dim, chosen):
    """plan() before any check(): the first forward picks the impl and completes the plan."""
    case = make_paged_case([1, 4], [6, 2], head_dim=head_dim, block_size=4, seed=9)
    backend = FlashVarlenBackend(NUM_HEADS, 2, head_dim, case.scale)
    out = run_step(backend, case)
    assert backend.active_impl == chosen
    assert backend.stats()["cpu_kernel_calls"] == (chosen == "cpu")
    assert_matches_reference(out, case, torch.float32)


def test_per_request_plans_decodes_as_plain_ints():
    """A decode's call is planned as its context length, a split size of the
    packed contexts, not as an object: only prompts and chunks get a SeqAttention."""
    case = make_paged_case([1, 1, 1, 4], [6, 9, 3, 2], block_size=4)
    plan = PerRequestBackend(NUM_HEADS, 2, HEAD_DIM, 1.0).plan(case.meta())
    assert plan.num_one_query_seqs == 3 and plan.one_query_start == 0
    assert plan.key_splits == [7, 10, 4, 6]  # the decodes' contexts, then the chunk's
    assert len(plan.seqs) == 1 and plan.seqs[0].key_start == 21


@pytest.mark.parametrize("backend_cls", [PaddedBackend, PerRequestBackend])
def test_simple_backends_accept_everything(backend_cls):
    backend = backend_cls(NUM_HEADS, 2, HEAD_DIM, 1.0)
    backend.check(FakeAllocator(block_size=1), torch.device("cpu"), torch.float64)


# -- padded's waste figures


def test_padded_stats_count_padding_per_step_not_per_layer():
    backend = PaddedBackend(NUM_HEADS, 2, HEAD_DIM, HEAD_DIM**-0.5)
    assert all(value == 0 for value in backend.stats().values())
    steps = [([1, 5], [9, 0]), ([1, 1, 3], [3, 30, 4])]
    expected = dict(
        real_query_tokens=0, padded_query_slots=0, real_key_tokens=0, padded_key_slots=0
    )
    for query_lens, context_lens in steps:
        case = make_paged_case(query_lens, context_lens, block_size=4)
        seq_lens = case.seq_lens
        plan = backend.plan(case.meta())
        for _ in range(3):  # three layers, one step
            backend.forward(case.q, case.k_new, case.v_new, (case.k_cache, case.v_cache), plan)
        n = len(query_lens)
        expected["real_query_tokens"] += sum(query_lens)
        expected["padded_query_slots"] += n * max(query_lens) - sum(query_lens)
        expected["real_key_tokens"] += sum(seq_lens)
        expected["padded_key_slots"] += n * max(seq_lens) - sum(seq_lens)
    stats = backend.stats()
    assert stats["planned_steps"] == len(steps)
    for key, value in expected.items():
        assert stats[key] == value, key
    # by hand: a decode padded to 5 query rows (4 slots), then 3 rows of 3 for 5 tokens (4)
    assert expected["padded_query_slots"] == (2 * 5 - 6) + (3 * 3 - 5)


# -- registration


@pytest.mark.parametrize(
    ("module", "name", "cls"),
    [
        (padded, "padded", PaddedBackend),
        (per_request, "per_request", PerRequestBackend),
        (flash_varlen, "flash_varlen", FlashVarlenBackend),
    ],
)
def test_registers_through_hook(module, name, cls):
    hook = module.servelab_register_attention_backends
    assert hasattr(hook, "servelab_impl"), "missing @hookimpl"
    assert hook() == {name: cls}
    assert issubclass(cls, AttentionBackend) and cls.description


def test_reference_module_writes_like_slot_mapping():
    """The test helper itself: its (block, offset) loop agrees with meta.slot_mapping."""
    case = make_paged_case([2, 3], [5, 1], block_size=4, seed=4)
    k_cache = torch.zeros_like(case.k_cache)
    v_cache = torch.zeros_like(case.v_cache)
    for i, (c, s) in enumerate(zip(case.context_lens, case.seq_lens, strict=True)):
        write_positions(k_cache, v_cache, case.block_tables[i], case.keys[i], case.values[i], c, s)
    flat = k_cache.view(-1, *k_cache.shape[2:])
    torch.testing.assert_close(flat[case.meta().slot_mapping], case.k_new, rtol=0, atol=0)
    assert math.isnan(case.k_cache[case.block_tables[0][-1], -1, 0, 0])  # unwritten slot


# -- the GPU branches' plumbing, on CPU: stand-in kernels with FlashAttention's semantics


def _fake_kernel(q, k, v, cu_q, cu_k, max_q, max_k, scale, seqused_k=None, block_table=None):
    """FlashAttention semantics via the reference; packed K/V become one-token pages."""
    assert cu_q.dtype == torch.int32 and cu_k.dtype == torch.int32
    if block_table is None:
        starts = cu_k[:-1].long().unsqueeze(1)
        block_table = (starts + torch.arange(max_k)).clamp(max=k.shape[0] - 1).int()
        k, v = k.unsqueeze(1), v.unsqueeze(1)
    assert block_table.dtype == torch.int32
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return varlen_attention_reference(
        q, k, v, cu_q, cu_k, block_table, max_q, max_k, scale, seqused_k=seqused_k
    )


def varlen_attn_2_9(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):  # fmt: skip
    assert is_causal and key.shape[1] == query.shape[1], "no GQA before 2.12"
    return _fake_kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, None)


def varlen_attn_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)):  # fmt: skip
    assert tuple(window_size) == (-1, 0) and key.shape[1] == query.shape[1]
    return _fake_kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale)


def varlen_attn_2_12(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):  # fmt: skip
    assert tuple(window_size) == (-1, 0)
    heads_k = key.shape[2] if block_table is not None else key.shape[1]
    assert enable_gqa or heads_k == query.shape[1]
    assert block_table is None or seqused_k is not None, "block_table requires seqused_k"
    return _fake_kernel(
        query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, seqused_k, block_table
    )


@pytest.mark.parametrize("block_size", [4, 256])
@pytest.mark.parametrize(
    "fake", [varlen_attn_2_9, varlen_attn_2_10, varlen_attn_2_12], ids=["2.9", "2.10", "2.12"]
)
def test_torch_impl_plumbing(monkeypatch, fake, block_size):
    monkeypatch.setattr(varlen_impls, "_torch_varlen_attn", lambda: fake)
    case = make_paged_case([1, 1, 6, 5], [9, 20, 0, 11], block_size=block_size, seed=12)
    backend = FlashVarlenBackend(NUM_HEADS, 2, HEAD_DIM, scale=0.3, impl="torch")
    backend.active_impl, backend._torch_call = (
        "torch",
        flash_varlen.TorchVarlenCall.inspect(block_size),
    )
    assert backend._torch_call.paged == (fake is varlen_attn_2_12 and block_size == 256)
    case.scale = 0.3  # not 1/sqrt(head_dim): 2.9 has no scale argument, q must be rescaled
    expected_caches = case.expected_caches()
    out = run_step(backend, case)
    assert_matches_reference(out, case, torch.float32)
    assert_cache_written(case, expected_caches)


@pytest.mark.parametrize("batch", ["decode_only", "mixed", "chunks_mid_context"])
def test_flash_attn_impl_plumbing(batch):
    calls = []

    def varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None, causal=False, block_table=None):  # fmt: skip
        assert causal and block_table is not None and k.dim() == 4
        calls.append("varlen")
        return _fake_kernel(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, block_table=block_table)  # fmt: skip

    def with_kvcache(q, k_cache, v_cache, cache_seqlens=None, block_table=None, softmax_scale=None, causal=False):  # fmt: skip
        assert q.dim() == 4 and q.shape[1] == 1 and cache_seqlens.dtype == torch.int32
        calls.append("kvcache")
        batch_size = q.shape[0]
        cu_q = torch.arange(batch_size + 1, dtype=torch.int32)
        cu_k = torch.cat([torch.zeros(1, dtype=torch.int32), cache_seqlens.cumsum(0).int()])
        out = _fake_kernel(q.squeeze(1), k_cache, v_cache, cu_q, cu_k, 1, int(cache_seqlens.max()), softmax_scale, block_table=block_table)  # fmt: skip
        return out.unsqueeze(1)

    query_lens, context_lens = BATCHES[batch]
    case = make_paged_case(query_lens, context_lens, block_size=4, seed=13)
    backend = FlashVarlenBackend(NUM_HEADS, 2, HEAD_DIM, case.scale, impl="flash_attn")
    backend.active_impl, backend._flash_fns = "flash_attn", (varlen_func, with_kvcache)
    out = run_step(backend, case)
    assert calls == ["kvcache" if batch == "decode_only" else "varlen"]
    assert_matches_reference(out, case, torch.float32)
