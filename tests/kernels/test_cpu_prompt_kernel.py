"""The bf16 prompt-attention kernel (`cpu_paged.paged_prefill_bf16`), alone and
inside `flash_varlen` impl=cpu.

Kernel level: prompt chunks (fresh prompts, chunks over a cached context, one-token
chunks) against the naive float64 attention of `tests.attention_reference` over
the same bf16 values, for every head size, grouped heads of several ratios, block
sizes 1, 5 and 16 in shuffled physical order, lengths around the kernel's 16-key
tiles and 16-row blocks. NaN fills every unwritten cache slot, so a read past a
sequence's end shows, and every row of `out` the call does not own.

The tolerance is derived, not fitted: the kernel rounds each probability to bf16
(relative error at most 2^-9) before weighting the values, while the softmax's sum
is kept in float32, so the output moves by at most 2^-9 * max|v|; the output is
then rounded to bf16 once (2^-8 relative covers it); float32 sums are far below both.
"""

from __future__ import annotations

import pytest
import torch

from servelab.kernels import cpu_paged
from servelab.plugins.attention.flash_varlen import SDPA_PROMPT_TOKENS, FlashVarlenBackend
from servelab.testing.oracle import restored_num_threads
from tests.attention_reference import make_paged_case, naive_causal_attention
from tests.plugins.test_attention_backends import FakeAllocator, run_impl

KERNEL = cpu_paged  # see conftest.needs_the_kernel

pytestmark = pytest.mark.skipif(
    cpu_paged.kernel() is not None and not cpu_paged.prefill_bf16_available(),
    reason="this CPU has no AVX512-BF16: the prompt kernel is not built for it",
)

# (query_lens, context_lens): fresh prompts and chunks over cached keys, around the
# 16-key tiles and 16-row blocks, and one-token rows among them
BATCHES = {
    "fresh": ([1, 7, 16, 17, 40], [0, 0, 0, 0, 0]),
    "chunks": ([5, 33, 16], [11, 16, 70]),
    "mixed": ([1, 1, 20, 3], [9, 31, 4, 0]),
}


def prompt_case(batch, num_heads, num_kv_heads, head_dim, block_size, seed=0):
    query_lens, context_lens = BATCHES[batch]
    case = make_paged_case(
        query_lens, context_lens, num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, block_size=block_size, dtype=torch.bfloat16, seed=seed,
    )  # fmt: skip
    case.k_cache, case.v_cache = case.expected_caches()  # this step's K/V stored
    return case


def kernel_out(case, first=0, **overrides):
    """The kernel over the case's sequences `first..`, into a NaN-filled output."""
    meta = case.meta()
    args = dict(
        q=case.q,
        k_cache=case.k_cache,
        v_cache=case.v_cache,
        block_tables=meta.block_tables[first:],
        q_starts=meta.query_start_loc[first:].contiguous(),
        seq_lens=meta.seq_lens[first:],
        scale=case.scale,
        out=torch.full(case.q.shape, float("nan"), dtype=case.q.dtype),
    )
    args.update(overrides)
    cpu_paged.paged_prefill_bf16(*args.values())
    return args["out"]


def assert_within_bf16(out, case, rows=slice(None)):
    want = naive_causal_attention(case.q, case.keys, case.values, case.query_lens, case.scale)
    v_max = max(float(v.double().abs().max()) for v in case.values)
    torch.testing.assert_close(
        out[rows].double(), want[rows], rtol=2.0**-8, atol=2.0**-9 * v_max + 1e-6
    )


@pytest.mark.parametrize("block_size", [1, 5, 16])
@pytest.mark.parametrize("head_dim", cpu_paged.HEAD_DIMS)
@pytest.mark.parametrize("batch", list(BATCHES))
def test_matches_naive_attention(batch, head_dim, block_size):
    case = prompt_case(batch, 4, 2, head_dim, block_size, seed=head_dim + block_size)
    out = kernel_out(case)
    assert out.dtype == torch.bfloat16 and not out.isnan().any()
    assert_within_bf16(out, case)


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads"), [(4, 4), (8, 1), (6, 2), (16, 8), (12, 3)], ids=str
)
def test_every_grouped_query_ratio(num_heads, num_kv_heads):
    """A KV head's query rows are its group's heads at every token, 16 at a time:
    groups of 1, 2, 3, 4 and 8 heads make blocks that end mid-token."""
    case = prompt_case("chunks", num_heads, num_kv_heads, 32, 4, seed=num_heads)
    assert_within_bf16(kernel_out(case), case)


def test_writes_only_the_rows_it_is_given():
    """The sequences after the leading one-query rows, as impl=cpu passes them:
    the decode rows of `out` stay untouched (NaN)."""
    case = prompt_case("mixed", 4, 2, 64, 16, seed=3)
    out = kernel_out(case, first=2)
    assert out[:2].isnan().all() and not out[2:].isnan().any()
    assert_within_bf16(out, case, rows=slice(2, None))


def test_large_scores_stay_finite():
    """Scores spread over hundreds (exp overflows float32 past 88): the online
    softmax subtracts each row's running maximum."""
    case = prompt_case("chunks", 4, 2, 64, 16, seed=4)
    case.q = (case.q.double() * 100).to(torch.bfloat16)
    out = kernel_out(case)
    assert torch.isfinite(out).all()
    assert_within_bf16(out, case)


@pytest.mark.parametrize("num_threads", [1, 3])
def test_results_do_not_depend_on_the_thread_count(num_threads):
    """Each (sequence, KV head) runs whole on one thread, its tiles in key order."""
    case = prompt_case("chunks", 8, 2, 64, 16, seed=5)
    with restored_num_threads(2):
        two = kernel_out(case)
    with restored_num_threads(num_threads):
        other = kernel_out(case)
    assert torch.equal(other, two)


def test_rejects_inputs_it_cannot_read():
    case = prompt_case("fresh", 4, 2, 64, 16, seed=6)
    meta = case.meta()
    with pytest.raises(RuntimeError, match="must be bfloat16"):
        kernel_out(case, q=case.q.float(), out=torch.empty(case.q.shape))
    with pytest.raises(RuntimeError, match="int32"):
        kernel_out(case, seq_lens=meta.seq_lens.long())
    short = meta.seq_lens.clone()
    short[-1] = 3  # fewer keys than the sequence's 40 queries
    with pytest.raises(RuntimeError, match="keys must cover its queries"):
        kernel_out(case, seq_lens=short)
    with pytest.raises(RuntimeError, match="shaped like q"):
        kernel_out(case, out=torch.empty(1, 4, 64, dtype=torch.bfloat16))


def test_flash_varlen_cpu_takes_it_for_long_bf16_chunks():
    """impl=cpu in bf16: a step with a chunk of SDPA_PROMPT_TOKENS or more runs its
    decodes through the decode kernel and its chunks through this one, once per
    layer; the output is the reference impl's within bf16 rounding, and the cache
    holds the step's K/V."""
    query_lens, context_lens = [1, 1, SDPA_PROMPT_TOKENS + 1, 24], [8, 31, 5, 0]
    case = make_paged_case(
        query_lens, context_lens, num_heads=4, num_kv_heads=2, head_dim=64,
        dtype=torch.bfloat16, seed=7,
    )  # fmt: skip
    out, backend = run_impl("cpu", case, 4, 2, 64, torch.bfloat16)
    assert backend.stats() == {"cpu_kernel_calls": 1, "cpu_prompt_kernel_calls": 1}
    assert_within_bf16(out, case)
    # a float32 backend never takes it
    wide = FlashVarlenBackend(4, 2, 64, case.scale, impl="cpu")
    wide.check(FakeAllocator(16), torch.device("cpu"), torch.float32)
    assert not wide._prompt_kernel
