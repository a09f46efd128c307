"""The C++ paged decode kernel (`cpu_paged`), alone and inside an engine.

Kernel level: one query per sequence over its paged context against the naive
float64 attention of `tests.attention_reference` (unpaged K/V, an explicit
causal loop), for every head size it serves, grouped heads of any ratio,
contexts ending on and around its 16-key (float32) / 8-key (float64) tiles,
block sizes 1, 5 and 16 in shuffled physical order. NaN fills every unwritten
cache slot, so a read past a sequence's end shows.

The fused K/V store (`cpu_paged.store_kv`) against `per_request.store_kv`, exactly.

Engine level: float32 greedy runs with impl=cpu and impl=reference produce
the same tokens, and the kernel really ran (its call counter), one call per
layer of every step that decoded.
"""

from __future__ import annotations

import pytest
import torch

from servelab.kernels import cpu_matmul, cpu_paged
from servelab.kernels.cpp_extension import CSRC, load_extension
from servelab.plugins.attention import per_request
from servelab.plugins.attention.flash_varlen import FlashVarlenBackend
from servelab.testing.oracle import cached_case, engine_options, restored_num_threads
from tests.attention_reference import make_paged_case, naive_causal_attention

KERNEL = cpu_paged  # see conftest.needs_the_kernel


TOLERANCE = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.float64: dict(atol=1e-12, rtol=1e-12)}
# context lengths around the tiles (16 keys for float32, 8 for float64) and past several
LENGTHS = [1, 2, 7, 8, 9, 15, 16, 17, 33, 70]


def decode_case(num_heads, num_kv_heads, head_dim, block_size, dtype, lengths=LENGTHS, seed=0):
    """Every sequence decodes its last position: the whole context is in the cache."""
    case = make_paged_case(
        [1] * len(lengths), [n - 1 for n in lengths], num_heads=num_heads,
        num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size, dtype=dtype,
        seed=seed,
    )  # fmt: skip
    case.k_cache, case.v_cache = case.expected_caches()  # this step's K/V stored
    return case


def kernel_out(case, q=None, call=cpu_paged.paged_decode, **overrides):
    """`call` (the kernel, or another build's `paged_decode`) on the case's tensors,
    any of them overridden."""
    meta = case.meta()
    args = dict(
        q=case.q if q is None else q,
        k_cache=case.k_cache,
        v_cache=case.v_cache,
        block_tables=meta.block_tables,
        seq_lens=meta.seq_lens,
        scale=case.scale,
    )
    args.update(overrides)
    return call(*args.values())


def as_dtype(case, dtype) -> dict:
    """The case's q and caches in `dtype`, as `kernel_out` overrides."""
    return dict(q=case.q.to(dtype), k_cache=case.k_cache.to(dtype), v_cache=case.v_cache.to(dtype))


def expected(case):
    return naive_causal_attention(case.q, case.keys, case.values, case.query_lens, case.scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("block_size", [1, 5, 16])
@pytest.mark.parametrize("head_dim", cpu_paged.HEAD_DIMS)
def test_matches_naive_attention(head_dim, block_size, dtype):
    case = decode_case(4, 2, head_dim, block_size, dtype, seed=head_dim + block_size)
    out = kernel_out(case)
    assert out.shape == case.q.shape and out.dtype == dtype and out.is_contiguous()
    torch.testing.assert_close(out.double(), expected(case), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads"),
    [(4, 4), (2, 1), (8, 2), (8, 1), (16, 1), (3, 1), (12, 2), (6, 6)],
    ids=lambda n: str(n),
)
def test_every_grouped_query_ratio(num_heads, num_kv_heads, dtype):
    """Groups of 1, 2, 4, 8 and 16 heads run in passes of up to 8; 3 and 6, one head at a time."""
    case = decode_case(num_heads, num_kv_heads, 32, 4, dtype, seed=num_heads * num_kv_heads)
    torch.testing.assert_close(kernel_out(case).double(), expected(case), **TOLERANCE[dtype])


def test_large_scores_stay_finite_and_exact():
    """Scores spread over hundreds within one tile (exp overflows float32 past
    88): the online softmax must subtract each tile's true maximum."""
    case = decode_case(4, 2, 64, 16, torch.float32, lengths=[3, 40, 300], seed=3)
    case.q = case.q * 200  # scores ~ N(0, 200^2)
    out = kernel_out(case)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), expected(case), **TOLERANCE[torch.float32])


def test_a_long_context():
    case = decode_case(8, 2, 128, 16, torch.float32, lengths=[1500, 5], seed=4)
    torch.testing.assert_close(kernel_out(case).double(), expected(case), atol=2e-5, rtol=1e-4)


def test_reads_a_strided_query_view_and_the_first_table_rows():
    """q as the model passes it (a slice of the fused QKV projection), and tables
    with more rows than queries (the decode part of a mixed step)."""
    case = decode_case(4, 2, 64, 16, torch.float32, seed=5)
    fused = torch.randn(case.q.shape[0], 4 + 2 * 2, 64)
    fused[:, :4] = case.q
    q_view = fused[:, :4]
    assert not q_view.is_contiguous()
    meta = case.meta()
    extra_row = torch.zeros(1, meta.block_tables.shape[1], dtype=torch.int32)
    tables = torch.cat([meta.block_tables, extra_row])
    lens = torch.cat([meta.seq_lens, torch.tensor([7], dtype=torch.int32)])
    out = kernel_out(case, q=q_view, block_tables=tables, seq_lens=lens)
    torch.testing.assert_close(out, kernel_out(case), rtol=0, atol=0)
    torch.testing.assert_close(out.double(), expected(case), **TOLERANCE[torch.float32])


def test_an_empty_context_gives_zeros_like_the_reference():
    case = decode_case(4, 2, 16, 4, torch.float32, lengths=[5, 9], seed=6)
    lens = case.meta().seq_lens.clone()
    lens[0] = 0
    out = kernel_out(case, seq_lens=lens)
    assert torch.count_nonzero(out[0]) == 0
    torch.testing.assert_close(out[1:].double(), expected(case)[1:], **TOLERANCE[torch.float32])


@pytest.mark.parametrize("num_threads", [1, 3])
def test_results_do_not_depend_on_the_thread_count(num_threads):
    """Each (sequence, KV head) runs whole on one thread, in key order: bit-identical."""
    case = decode_case(8, 2, 64, 16, torch.float32, lengths=list(range(1, 120, 7)), seed=7)
    with restored_num_threads(2):
        two = kernel_out(case)
    with restored_num_threads(num_threads):
        other = kernel_out(case)
    torch.testing.assert_close(other, two, rtol=0, atol=0)


@pytest.mark.parametrize("block_size", [1, 5, 16])
@pytest.mark.parametrize("head_dim", cpu_paged.HEAD_DIMS)
def test_bfloat16_is_the_float32_kernel_on_widened_inputs_rounded_once(head_dim, block_size):
    """bfloat16 q and caches are widened exactly as read and summed in float32:
    the result is the float32 kernel's on the widened tensors, rounded to bfloat16
    by torch (round to nearest even), bit for bit. Where the build has AVX512-BF16
    and a head is whole 32-element registers, `vdpbf16ps` sums the scores from the
    same exact products in another order, so an output may round to the
    neighbouring bfloat16 instead: within one bfloat16 step."""
    case = decode_case(4, 2, head_dim, block_size, torch.bfloat16, seed=head_dim + block_size)
    out = kernel_out(case)
    assert out.shape == case.q.shape and out.dtype == torch.bfloat16 and out.is_contiguous()
    wide = kernel_out(case, **as_dtype(case, torch.float32)).to(torch.bfloat16)
    if cpu_paged.prefill_bf16_available() and head_dim % 32 == 0:  # the vdpbf16ps scores
        torch.testing.assert_close(out.float(), wide.float(), rtol=2.0**-7, atol=1e-6)
    else:
        assert torch.equal(out, wide)
    # and within bfloat16 rounding of float64 attention over the same (bf16) values
    torch.testing.assert_close(out.double(), expected(case), rtol=2.0**-8, atol=1e-5)


def test_bfloat16_rounds_ties_to_even_and_keeps_nan():
    """Two keys with equal scores: the output is the mean of their V rows, exact
    in float32. The rows are bfloat16 values whose means lie exactly between two
    bfloat16s (a tie to round down to even, one to round up), past a tie, and
    NaN; the kernel's rounding of them equals torch's (NaN stays a NaN)."""
    case = decode_case(2, 1, 16, 4, torch.float32, lengths=[2], seed=3)
    block = int(case.meta().block_tables[0, 0])
    case.k_cache[block, :2] = 0.5  # equal keys: equal scores, probabilities 1/2 each
    step = 2.0**-7  # bfloat16's spacing in [1, 2)
    first = torch.tensor([1.0, 1 + step, 1.0, float("nan")] * 4)
    second = torch.tensor([1 + step, 1 + 2 * step, 3 * 2.0**-9, 1.0] * 4)
    case.v_cache[block, 0, 0], case.v_cache[block, 1, 0] = first, second
    wide = kernel_out(case)[0, 0]
    assert wide[:3].tolist() == [1 + step / 2, 1 + 3 * step / 2, 0.5 + 3 * 2.0**-10]
    narrow = kernel_out(case, **as_dtype(case, torch.bfloat16))[0, 0]
    # two ties to even (down, then up), and 3/4 of a step (2^-8 in [0.5, 1)) up
    assert narrow[:3].tolist() == [1.0, 1 + 2 * step, 0.5 + 2.0**-8]
    rounded = wide.to(torch.bfloat16)
    torch.testing.assert_close(narrow, rounded, rtol=0, atol=0, equal_nan=True)
    assert torch.isnan(narrow[3::4]).all()


# AVX2 with FMA, no AVX-512: the target of the kernel's AVX2-only branch
AVX2_CFLAGS = ("-O3", "-march=haswell", "-fopenmp")


def test_an_avx2_build_agrees_with_the_native_one():
    """The kernel built for an AVX2 CPU (its ymm branch), run on this one: float32
    within rounding of the native build, float64 too, and bfloat16 equal to the
    AVX2 build's own float32 on the widened inputs, rounded once. Skipped only on a
    CPU that cannot run AVX2 code."""
    if not {"avx2", "fma"} <= cpu_matmul.cpu_flags():
        pytest.skip("this CPU cannot run an AVX2 build")
    avx2 = load_extension(
        "servelab_cpu_paged_decode_avx2", [CSRC / "cpu_paged.cpp"], include_dirs=[CSRC],
        cflags=AVX2_CFLAGS,
    )  # fmt: skip
    for head_dim in (16, 32, 128):
        for dtype in (torch.float32, torch.float64):
            case = decode_case(8, 2, head_dim, 5, dtype, seed=head_dim)
            got = kernel_out(case, call=avx2.paged_decode)
            torch.testing.assert_close(got, kernel_out(case), **TOLERANCE[dtype])
            torch.testing.assert_close(got.double(), expected(case), **TOLERANCE[dtype])
        case = decode_case(8, 2, head_dim, 5, torch.bfloat16, seed=head_dim)
        narrow = kernel_out(case, call=avx2.paged_decode)
        wide = kernel_out(case, call=avx2.paged_decode, **as_dtype(case, torch.float32))
        assert torch.equal(narrow, wide.to(torch.bfloat16))


def test_rejects_inputs_it_cannot_read():
    case = decode_case(4, 2, 64, 16, torch.float32, lengths=[5], seed=8)
    with pytest.raises(RuntimeError, match="int32"):
        kernel_out(case, seq_lens=case.meta().seq_lens.long())
    with pytest.raises(RuntimeError, match="share a dtype"):
        kernel_out(case, q=case.q.double())
    with pytest.raises(RuntimeError, match="float32, float64 or bfloat16 only"):
        kernel_out(case, **as_dtype(case, torch.float16))


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float64, torch.bfloat16], ids=["fp32", "fp64", "bf16"]
)
def test_store_kv_writes_like_index_copy(dtype):
    """The fused store against `per_request.store_kv`: exact, strided K/V views (as
    the model passes them), every other slot untouched (NaN stays NaN)."""
    case = make_paged_case([1, 3, 1], [4, 0, 9], head_dim=32, block_size=4, dtype=dtype, seed=9)
    fused = torch.randn(case.k_new.shape[0], 4 + 2 * 2, 32, dtype=dtype)
    fused[:, 4:6], fused[:, 6:] = case.k_new, case.v_new
    k_view, v_view = fused[:, 4:6], fused[:, 6:]
    assert not k_view.is_contiguous()
    slots = case.meta().slot_mapping
    want = (case.k_cache.clone(), case.v_cache.clone())
    per_request.store_kv(case.k_new, case.v_new, *want, slots)
    cpu_paged.store_kv(k_view, v_view, case.k_cache, case.v_cache, slots)
    for got, expect in zip((case.k_cache, case.v_cache), want):
        torch.testing.assert_close(got, expect, rtol=0, atol=0, equal_nan=True)


def test_store_kv_rejects_a_slot_out_of_range_and_a_dtype_mismatch():
    case = make_paged_case([2], [0], head_dim=16, block_size=4, seed=10)
    num_slots = case.k_cache.shape[0] * case.k_cache.shape[1]
    bad = torch.tensor([0, num_slots], dtype=torch.int64)
    with pytest.raises(RuntimeError, match="out of range"):
        cpu_paged.store_kv(case.k_new, case.v_new, case.k_cache, case.v_cache, bad)
    with pytest.raises(RuntimeError, match="share a dtype"):
        slots = case.meta().slot_mapping
        cpu_paged.store_kv(case.k_new.double(), case.v_new, case.k_cache, case.v_cache, slots)


def test_problems_name_every_broken_constraint():
    assert cpu_paged.problems(torch.device("cpu"), torch.float32, 64) == []
    assert cpu_paged.problems(torch.device("cpu"), torch.bfloat16, 128) == []
    found = " | ".join(cpu_paged.problems(torch.device("cuda"), torch.float16, 80))
    assert "CPU (got cuda)" in found and "torch.float16" in found and "got 80" in found


def test_environment_switch_turns_the_kernel_off(monkeypatch):
    monkeypatch.setenv("SERVELAB_CPU_KERNEL", "0")
    cpu_paged.kernel.cache_clear()
    try:
        assert cpu_paged.kernel() is None
        (problem,) = cpu_paged.problems(torch.device("cpu"), torch.float32, 64)
        assert "SERVELAB_CPU_KERNEL=0" in problem
    finally:
        cpu_paged.kernel.cache_clear()


# -- inside an engine, float32


def greedy_run(impl: str):
    """The oracle's prompts through continuous + paged (block 4), float32: (tokens, engine)."""
    from servelab import LLM

    case = cached_case("qwen3")
    combo = dict(
        scheduler={"name": "continuous", "admission": "on_demand"},
        allocator={"name": "paged", "block_size": 4},
        preemption="recompute",
        attention={"name": "flash_varlen", "impl": impl},
    )
    with restored_num_threads():
        llm = LLM(model=str(case.folder), **combo, **engine_options(combo, dtype="float32"))
        outs = llm.generate(case.prompts, case.params)
    return [o.token_ids for o in outs], llm.engine


def test_engine_float32_cpu_kernel_matches_reference_tokens():
    tokens, engine = greedy_run("cpu")
    reference_tokens, _ = greedy_run("reference")
    assert tokens == reference_tokens
    backend = engine.backend
    assert isinstance(backend, FlashVarlenBackend) and backend.active_impl == "cpu"
    num_layers = engine.model_config.num_layers
    steps = engine.metrics.steps
    calls = [s.extra["attn_cpu_kernel_calls"] for s in steps]
    # the kernel ran in every layer of every step that decoded, and only whole steps
    assert all(c == num_layers for s, c in zip(steps, calls) if s.decode_tokens)
    assert set(calls) <= {0, num_layers}
    assert sum(calls) == backend.stats()["cpu_kernel_calls"] > 0
