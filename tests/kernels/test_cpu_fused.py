"""The fused C++ element-wise kernels (`servelab.kernels.cpu_fused`) against the
torch formulas of `servelab.model.transformer` they replace.

Each op against `transformer.rms_norm` and `transformer.apply_rope` (and
`argmax_rows` against `torch.argmax`) in float32 and float64: rows of odd widths (vector tails),
head sizes 64 and 128 (and 16 / 48, a head narrower than / not a multiple of
a float32 vector), 1 to 300 tokens, strided row views where an op takes them,
positions at the end of the RoPE tables. In-place ops really write (the
residual, the q/k heads) and nothing else (the v heads); results do not
depend on the thread count; every rejected input raises a message that names
the problem.

Tolerances: the kernels sum squares in vector lanes (torch in its own order),
so they agree with torch to a few ulps of O(1) values, not bit for bit: float32 eps is 1.2e-7, float64 eps 2.2e-16.
"""

from __future__ import annotations

import pytest
import torch

from servelab.kernels import cpu_fused
from servelab.model import transformer
from servelab.testing.oracle import restored_num_threads

KERNEL = cpu_fused  # see conftest.needs_the_kernel


DTYPES = [torch.float32, torch.float64]
DTYPE_IDS = ["fp32", "fp64"]
# about 8 ulps of values of order 1
TOLERANCE = {torch.float32: dict(rtol=1e-6, atol=1e-6), torch.float64: dict(rtol=1e-12, atol=1e-12)}
EPS = 1e-6
TOKENS = [1, 3, 64, 300]


def randn(*shape, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).mul(scale).to(dtype)


def norm_weight(size, dtype, seed):
    """Like a trained RMSNorm weight: around 1."""
    return 1 + randn(size, dtype=dtype, seed=seed, scale=0.2)


def rows_view(rows, width, dtype, seed, pad=0):
    """[rows, width], its rows `pad` elements apart beyond `width` (a view) when pad > 0."""
    wide = randn(rows, width + pad, dtype=dtype, seed=seed)
    view = wide[:, pad : pad + width]
    assert view.is_contiguous() == (pad == 0 or rows == 1)
    return view


def rope_tables(max_positions, head_dim, dtype):
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.arange(max_positions, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


# -- rms_norm and add_rms_norm


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("hidden", [72, 200, 256])
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("pad", [0, 40], ids=["contiguous", "strided"])
def test_rms_norm_matches_torch(dtype, hidden, tokens, pad):
    x = rows_view(tokens, hidden, dtype, seed=hidden + tokens, pad=pad)
    weight = norm_weight(hidden, dtype, seed=1)
    before = x.clone()
    out = cpu_fused.rms_norm(x, weight, EPS)
    assert out.shape == x.shape and out.dtype == dtype and out.is_contiguous()
    torch.testing.assert_close(out, transformer.rms_norm(x, weight, EPS), **TOLERANCE[dtype])
    assert torch.equal(x, before)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("hidden", [72, 200, 256])
@pytest.mark.parametrize("tokens", TOKENS)
def test_add_rms_norm_adds_in_place_and_normalises(dtype, hidden, tokens):
    residual = randn(tokens, hidden, dtype=dtype, seed=tokens)
    delta = rows_view(tokens, hidden, dtype, seed=hidden, pad=24)  # a strided view
    weight = norm_weight(hidden, dtype, seed=2)
    expected_sum = residual + delta
    out = cpu_fused.add_rms_norm(residual, delta, weight, EPS)
    assert torch.equal(residual, expected_sum)  # one rounding, the same as torch's add
    assert out.shape == residual.shape and out.is_contiguous()
    assert out.data_ptr() != residual.data_ptr()
    torch.testing.assert_close(
        out, transformer.rms_norm(expected_sum, weight, EPS), **TOLERANCE[dtype]
    )
    # one pass accumulates exactly as rms_norm does over the sum
    assert torch.equal(out, cpu_fused.rms_norm(residual, weight, EPS))


# -- qk_norm_rope_


def qkv_case(tokens, num_heads, num_kv_heads, head_dim, dtype, seed, max_positions=4096):
    qkv = randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, seed=seed)
    cos, sin = rope_tables(max_positions, head_dim, dtype)
    g = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, max_positions, (tokens,), generator=g)
    positions[-1] = max_positions - 1  # the tables' last row
    if tokens > 1:
        positions[0] = max_positions - 2
    return qkv, cos, sin, positions


def expected_qk(qkv, q_weight, k_weight, cos, sin, positions, num_heads, num_kv_heads):
    """The model's sequence (`Attention.forward`): per-head norm, then RoPE."""
    heads = qkv.view(qkv.shape[0], num_heads + 2 * num_kv_heads, -1)
    q, k = heads[:, :num_heads], heads[:, num_heads : num_heads + num_kv_heads]
    if q_weight is not None:
        q = transformer.rms_norm(q, q_weight, EPS)
    if k_weight is not None:
        k = transformer.rms_norm(k, k_weight, EPS)
    qk = torch.cat([q, k], dim=1)
    return transformer.apply_rope(qk, cos[positions].unsqueeze(1), sin[positions].unsqueeze(1))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("head_dim", [64, 128, 48, 16])
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("qk_norm", [True, False], ids=["qk_norm", "rope_only"])
def test_qk_norm_rope_matches_torch(dtype, head_dim, tokens, qk_norm):
    num_heads, num_kv_heads = 4, 2
    qkv, cos, sin, positions = qkv_case(tokens, num_heads, num_kv_heads, head_dim, dtype, seed=7)
    q_weight = norm_weight(head_dim, dtype, seed=3) if qk_norm else None
    k_weight = norm_weight(head_dim, dtype, seed=4) if qk_norm else None
    before = qkv.clone()
    want = expected_qk(qkv, q_weight, k_weight, cos, sin, positions, num_heads, num_kv_heads)
    assert cpu_fused.qk_norm_rope_(
        qkv, q_weight, k_weight, EPS, cos, sin, positions, num_heads, num_kv_heads
    ) is None  # fmt: skip
    heads = qkv.view(tokens, num_heads + 2 * num_kv_heads, head_dim)
    torch.testing.assert_close(heads[:, : num_heads + num_kv_heads], want, **TOLERANCE[dtype])
    v_before = before.view_as(heads)[:, num_heads + num_kv_heads :]
    assert torch.equal(heads[:, num_heads + num_kv_heads :], v_before)  # v heads untouched


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads"), [(1, 1), (8, 1), (3, 2)], ids=["1-1", "8-1", "3-2"]
)
def test_qk_norm_rope_other_head_counts_and_one_weight(num_heads, num_kv_heads):
    """Any numbers of q and k heads; q_weight alone normalises only the q heads."""
    dtype = torch.float32
    qkv, cos, sin, positions = qkv_case(5, num_heads, num_kv_heads, 64, dtype, seed=num_heads)
    q_weight = norm_weight(64, dtype, seed=5)
    want = expected_qk(qkv, q_weight, None, cos, sin, positions, num_heads, num_kv_heads)
    cpu_fused.qk_norm_rope_(qkv, q_weight, None, EPS, cos, sin, positions, num_heads, num_kv_heads)
    heads = qkv.view(5, num_heads + 2 * num_kv_heads, 64)[:, : num_heads + num_kv_heads]
    torch.testing.assert_close(heads, want, **TOLERANCE[dtype])


def test_no_tokens():
    """An empty batch: empty results, nothing read."""
    empty = torch.empty(0, 256)
    weight = norm_weight(256, torch.float32, seed=0)
    assert cpu_fused.rms_norm(empty, weight, EPS).shape == (0, 256)
    assert cpu_fused.add_rms_norm(empty, empty, weight, EPS).shape == (0, 256)
    qkv, cos, sin, _ = qkv_case(1, 4, 2, 64, torch.float32, seed=0)
    positions = torch.empty(0, dtype=torch.int64)
    cpu_fused.qk_norm_rope_(qkv[:0], None, None, EPS, cos, sin, positions, 4, 2)


# -- threads


def all_ops(seed, dtype=torch.float32, tokens=300):
    """Every op once, at a size large enough to split over threads."""
    x = randn(tokens, 256, dtype=dtype, seed=seed)
    weight = norm_weight(256, dtype, seed=seed + 1)
    residual = randn(tokens, 256, dtype=dtype, seed=seed + 2)
    qkv, cos, sin, positions = qkv_case(tokens, 4, 2, 64, dtype, seed=seed + 3)
    qk_w = norm_weight(64, dtype, seed=seed + 4), norm_weight(64, dtype, seed=seed + 5)
    cpu_fused.qk_norm_rope_(qkv, *qk_w, EPS, cos, sin, positions, 4, 2)
    normed = cpu_fused.add_rms_norm(residual, x, weight, EPS)
    return [cpu_fused.rms_norm(x, weight, EPS), residual, normed, qkv]


def test_every_op_splits_rows_over_threads_at_these_sizes():
    """The sizes `all_ops` uses are large enough for each op to use threads."""
    assert 300 * 256 >= cpu_fused.PARALLEL_MIN_WORK  # rms_norm's cost, the smallest


@pytest.mark.parametrize("num_threads", [1, 3])
def test_results_do_not_depend_on_the_thread_count(num_threads):
    """Each row is computed whole by one thread: bit-identical for any count."""
    with restored_num_threads(2):
        two = all_ops(seed=11)
    with restored_num_threads(num_threads):
        other = all_ops(seed=11)
    for a, b in zip(two, other, strict=True):
        assert torch.equal(a, b)


# -- rejected inputs


def test_rms_norm_rejects_what_it_cannot_read():
    x = randn(4, 64, dtype=torch.float32, seed=0)
    w = norm_weight(64, torch.float32, seed=0)
    cases = [
        ((x.bfloat16(), w.bfloat16()), "x must be float32 or float64"),
        ((x.long(), w), "x must be float32 or float64"),
        ((x, w.double()), "weight must have x's dtype"),
        ((x, w[:32]), r"weight must have shape \[64\]"),
        ((x, torch.stack([w, w], 1)[:, 0]), "weight must be contiguous"),
        ((x[0], w), "x must have 2 dims"),
        ((randn(64, 4, dtype=torch.float32, seed=0).t(), w[:4]), "last dim must be contiguous"),
        ((x.to("meta"), w), "x must be a CPU tensor"),
        ((x, w.to("meta")), "weight must be a CPU tensor"),
    ]
    for args, message in cases:
        with pytest.raises(RuntimeError, match=message):
            cpu_fused.rms_norm(*args, EPS)


def test_add_rms_norm_rejects_what_it_cannot_read():
    r = randn(4, 64, dtype=torch.float32, seed=0)
    w = norm_weight(64, torch.float32, seed=0)
    wide = randn(4, 96, dtype=torch.float32, seed=1)
    cases = [
        ((wide[:, :64], r, w), "residual must be contiguous"),
        ((r, r.double(), w), "delta must have residual's dtype"),
        ((r, r[:3], w), "delta must have residual's shape"),
        ((r, r, w[:8]), r"weight must have shape \[64\]"),
        ((r.half(), r.half(), w.half()), "residual must be float32 or float64"),
    ]
    for args, message in cases:
        before = args[0].clone()
        with pytest.raises(RuntimeError, match=message):
            cpu_fused.add_rms_norm(*args, EPS)
        assert torch.equal(args[0], before)  # checked before anything is written


def test_qk_norm_rope_rejects_what_it_cannot_read():
    qkv, cos, sin, positions = qkv_case(3, 4, 2, 64, torch.float32, seed=0, max_positions=50)
    w = norm_weight(64, torch.float32, seed=0)
    good = dict(
        qkv=qkv, q_weight=w, k_weight=w, eps=EPS, cos=cos, sin=sin, positions=positions,
        num_heads=4, num_kv_heads=2,
    )  # fmt: skip
    cases = [
        (dict(qkv=qkv.double()), "cos must have qkv's dtype"),
        (dict(qkv=qkv.bfloat16()), "qkv must be float32 or float64"),
        (dict(qkv=qkv.view(3, 8, 64)), "qkv must have 2 dims"),
        (dict(qkv=torch.cat([qkv, qkv], 1)[:, :512]), "qkv must be contiguous"),
        (dict(num_heads=3), r"width 512 must be \(num_heads \+ 2 \* num_kv_heads\)"),
        (dict(num_heads=0), "must be positive"),
        (dict(qkv=qkv[:, :504].contiguous()), "even head_dim"),
        (dict(cos=cos[:, :16]), r"cos must be \[max_positions, head_dim / 2 = 32\]"),
        (dict(sin=sin[:40]), "cos and sin must have the same shape"),
        (dict(sin=sin.double()), "sin must have qkv's dtype"),
        (dict(cos=torch.cat([cos, cos], 1)[:, :32]), "cos must be contiguous"),
        (dict(positions=positions.int()), "positions must be int64"),
        (dict(positions=positions[:2]), r"positions must be \[T\] = \[3\]"),
        (dict(q_weight=w[:32]), r"q_weight must have shape \[64\]"),
        (dict(k_weight=w.double()), "k_weight must have qkv's dtype"),
        (dict(positions=torch.tensor([0, 50, 1])), "position 50 of token 1 is outside"),
        (dict(positions=torch.tensor([-1, 0, 1])), "position -1 of token 0 is outside"),
    ]
    for overrides, message in cases:
        before = qkv.clone()
        with pytest.raises(RuntimeError, match=message):
            cpu_fused.qk_norm_rope_(**{**good, **overrides})
        assert torch.equal(qkv, before)  # checked before anything is written


def test_problems_name_every_broken_constraint():
    assert cpu_fused.problems(torch.device("cpu"), torch.float32) == []
    assert cpu_fused.problems(torch.device("cpu"), torch.float64) == []
    found = " | ".join(cpu_fused.problems(torch.device("cuda"), torch.bfloat16))
    assert "CPU (got cuda)" in found and "torch.bfloat16" in found


def test_environment_switch_turns_the_kernel_off(monkeypatch):
    monkeypatch.setenv("SERVELAB_CPU_KERNEL", "0")
    cpu_fused.kernel.cache_clear()
    try:
        assert cpu_fused.kernel() is None
        (problem,) = cpu_fused.problems(torch.device("cpu"), torch.float32)
        assert "SERVELAB_CPU_KERNEL=0" in problem
    finally:
        cpu_fused.kernel.cache_clear()


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("width", [1, 5, 16, 17, 1000, 1024])
def test_argmax_rows_follows_torchs_rules(dtype, width):
    """The first index of the largest value; a NaN is larger than any number
    (the first NaN wins); all -inf -> 0; ties -> the lowest index: exactly
    `torch.argmax`, row by row, on contiguous and strided rows."""
    gen = torch.Generator().manual_seed(width)
    x = torch.randn(12, width + 3, generator=gen, dtype=dtype)[:, :width]  # strided rows
    x[1, :] = 1.0  # every value tied
    x[2, width // 2] = float("nan")
    x[3, :] = float("-inf")
    x[4, -1] = float("nan")
    if width > 3:
        x[5, 1] = x[5, 3] = x[5].max() + 1  # the maximum twice
        x[6, 2] = float("inf")
    assert torch.equal(cpu_fused.argmax_rows(x), x.argmax(dim=-1))
    assert cpu_fused.argmax_rows(x[:0]).shape == (0,)


def test_argmax_rows_errors():
    with pytest.raises(RuntimeError, match="float32 or float64"):
        cpu_fused.argmax_rows(torch.zeros(2, 3, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="must not be empty"):
        cpu_fused.argmax_rows(torch.zeros(2, 0))
    with pytest.raises(RuntimeError, match="last dim must be contiguous"):
        cpu_fused.argmax_rows(torch.zeros(8, 4).T)
