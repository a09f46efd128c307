"""Our own Triton kernels for paged attention: a KV-store kernel and one attention kernel for
a mixed batch of prefill chunks and decodes, both reading and writing the layer cache through
slots and block tables, never a per-sequence copy.

Triton chooses between compiling and interpreting when a kernel is decorated, so without a
CUDA device (and unless the user chose) this module sets `TRITON_INTERPRET=1` before defining
its kernels: they then run on CPU tensors, slowly (large tiles: the interpreter pays per
program). `INTERPRETED` says which mode they were defined in. The kernels call no `@triton.jit`
helper of Triton's library (see `_MAX`), so they interpret even when torch imported
`triton.language` before this module set the variable."""

from __future__ import annotations

import os

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402  (must follow the TRITON_INTERPRET decision)
import triton.language as tl  # noqa: E402

from servelab.plugins.attention.triton_tiles import (  # noqa: E402
    AttentionTiles,
    attention_tiles,
    float32_scale,
    needs_64bit_offsets,
    store_tokens_per_program,
)

# tl.max and tl.sum are @triton.jit functions themselves. When triton.language
# was imported before TRITON_INTERPRET was set (torch imports it lazily, so an
# engine run usually has), they are compiled-mode functions that the
# interpreter refuses to call. tl.reduce with their combine functions works in
# both modes: the interpreter maps these two to numpy and never calls them.
_MAX = tl.standard._elementwise_max
_SUM = tl.standard._sum_combine


# ---------------------------------------------------------------- KV store


# step-varying counts are not specialised: one variant serves every batch size
@triton.jit(do_not_specialize=["num_tokens"])
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    num_tokens,
    block_size,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_kcb,
    stride_kcp,
    stride_kch,
    stride_kcd,
    stride_vcb,
    stride_vcp,
    stride_vch,
    stride_vcd,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
    OFFSET_64: tl.constexpr,
):
    """Copies BLOCK_T tokens' K and V ([num_kv_heads, head_dim] each, flattened
    into BLOCK_C columns) to their slots; a negative slot means "do not store"."""
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_C)
    head = cols // HEAD_DIM
    dim = cols % HEAD_DIM
    token_ok = tokens < num_tokens
    slots = tl.load(slot_mapping_ptr + tokens, mask=token_ok, other=-1)
    if OFFSET_64:
        slots = slots.to(tl.int64)
    mask = ((slots >= 0) & token_ok)[:, None] & (head < NUM_KV_HEADS)[None, :]
    block = slots // block_size
    offset = slots % block_size
    tok = tokens[:, None]
    if OFFSET_64:
        tok = tok.to(tl.int64)

    k = tl.load(
        k_ptr + tok * stride_kt + head[None, :] * stride_kh + dim[None, :] * stride_kd, mask=mask
    )
    v = tl.load(
        v_ptr + tok * stride_vt + head[None, :] * stride_vh + dim[None, :] * stride_vd, mask=mask
    )
    k_dst = (
        k_cache_ptr
        + block[:, None] * stride_kcb
        + offset[:, None] * stride_kcp
        + head[None, :] * stride_kch
        + dim[None, :] * stride_kcd
    )
    v_dst = (
        v_cache_ptr
        + block[:, None] * stride_vcb
        + offset[:, None] * stride_vcp
        + head[None, :] * stride_vch
        + dim[None, :] * stride_vcd
    )
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------- attention


@triton.jit
def _find_seq(query_start_loc_ptr, tile, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence owning flat query tile `tile`. Sequence i's tiles start at
    `query_start_loc[i] // BLOCK_Q + i`, a strictly increasing number, so a
    binary search finds the last sequence starting at or before `tile`."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


# the batch size and the block table's width vary step to step: one variant serves all
@triton.jit(do_not_specialize=["num_seqs", "stride_bt"])
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    num_seqs,
    scale,
    scale_residual,
    block_size,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_cb,
    stride_cp,
    stride_ch,
    stride_cd,
    stride_bt,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ACC_DTYPE: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    OFFSET_64: tl.constexpr,
):
    """One program: one query tile of one sequence for one KV head.

    The M dimension flattens (query row, head of the KV head's group): row m is
    query row `m // GROUP_PAD` and query head `kv_head * GROUP + m % GROUP_PAD`,
    so a GQA group shares every K/V load. Keys are walked BLOCK_N at a time up
    to the tile's last query position; each key's slot comes from the block
    table, so tiles need not align with pages. Online softmax in ACC_DTYPE.
    """
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP_PAD
    kv_head = tl.program_id(1)
    tile = tl.program_id(0)
    seq = _find_seq(query_start_loc_ptr, tile, num_seqs, BLOCK_Q)
    q_begin = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - q_begin
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - query_len
    q_row0 = (tile - (q_begin // BLOCK_Q + seq)) * BLOCK_Q
    if q_row0 >= query_len:
        return  # spare tile: the grid has one more tile per sequence than needed at most

    offs_m = tl.arange(0, BLOCK_M)
    q_row = q_row0 + offs_m // GROUP_PAD
    group_idx = offs_m % GROUP_PAD
    head = kv_head * GROUP + group_idx
    row_ok = (q_row < query_len) & (group_idx < GROUP)
    # Padding rows attend like the tile's last real row: finite, never stored.
    q_pos = context_len + tl.minimum(q_row, query_len - 1)
    offs_d = tl.arange(0, HEAD_DIM)

    # 64-bit scalar bases, 32-bit offsets inside a tile (OFFSET_64 where the host
    # found a layer too large for int32): a 64-bit offset per element costs the
    # registers a bandwidth-bound kernel needs for more blocks per SM.
    q_tile = q_ptr + q_begin.to(tl.int64) * stride_qt
    o_tile = out_ptr + q_begin.to(tl.int64) * stride_ot
    tile_cols = head[:, None] * stride_qh + offs_d[None, :] * stride_qd
    q_ptrs = q_tile + q_row[:, None] * stride_qt + tile_cols
    q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0).to(DOT_DTYPE)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=ACC_DTYPE)
    l_i = tl.full([BLOCK_M], 0.0, dtype=ACC_DTYPE)
    acc = tl.full([BLOCK_M, HEAD_DIM], 0.0, dtype=ACC_DTYPE)

    # Keys past the tile's last query position are never looked at.
    num_keys = tl.minimum(seq_len, context_len + q_row0 + BLOCK_Q)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    head_cols = kv_head * stride_ch + offs_d[None, :] * stride_cd  # K and V share one layout
    for key0 in range(0, num_keys, BLOCK_N):
        keys = key0 + tl.arange(0, BLOCK_N)
        key_ok = keys < num_keys
        block = tl.load(table + keys // block_size, mask=key_ok, other=0)
        if OFFSET_64:
            block = block.to(tl.int64)
        slot_rows = block * stride_cb + (keys % block_size) * stride_cp
        kv_offsets = slot_rows[:, None] + head_cols
        k = tl.load(k_cache_ptr + kv_offsets, mask=key_ok[:, None], other=0.0).to(DOT_DTYPE)
        v = tl.load(v_cache_ptr + kv_offsets, mask=key_ok[:, None], other=0.0).to(DOT_DTYPE)

        scores = tl.dot(q, tl.trans(k), input_precision="ieee", out_dtype=ACC_DTYPE)
        if ACC_DTYPE == tl.float64:
            scores = scores * scale + scores * scale_residual
        else:
            scores = scores * scale
        # q_pos < num_keys, so this also hides the masked-out keys past num_keys.
        visible = keys[None, :] <= q_pos[:, None]
        scores = tl.where(visible, scores, float("-inf"))
        # Key 0 is visible to every row, so m_new is finite from the first tile on.
        m_new = tl.maximum(m_i, tl.reduce(scores, 1, _MAX))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.reduce(p, 1, _SUM)
        pv = tl.dot(p.to(DOT_DTYPE), v, input_precision="ieee", out_dtype=ACC_DTYPE)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    out = acc / l_i[:, None]
    o_ptrs = (
        o_tile
        + q_row[:, None] * stride_ot
        + head[:, None] * stride_oh
        + offs_d[None, :] * stride_od
    )
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


INTERPRETED: bool = type(_paged_attention_kernel).__name__ == "InterpretedFunction"
"""True when the kernels were defined under TRITON_INTERPRET (they run on CPU tensors)."""


# ---------------------------------------------------------------- launch parameters


def _require_runnable(*tensors: torch.Tensor) -> None:
    """Compiled kernels need CUDA tensors; interpreted ones run anywhere."""
    if INTERPRETED:
        return
    for t in tensors:
        if t.device.type != "cuda":
            raise RuntimeError(
                f"Triton kernels were compiled for the GPU but got a {t.device.type} tensor; "
                "set TRITON_INTERPRET=1 before importing servelab.plugins.attention.triton_kernels "
                "to run them on the CPU"
            )


# ---------------------------------------------------------------- public API


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Writes token t's K and V (`[num_tokens, num_kv_heads, head_dim]`) into
    the caches (`[num_blocks, block_size, num_kv_heads, head_dim]`) at slot
    `slot_mapping[t]` (block `slot // block_size`, offset `slot % block_size`).
    Tokens with a negative slot are skipped; nothing else is written."""
    num_tokens, num_kv_heads, head_dim = k.shape
    assert slot_mapping.shape == (num_tokens,), (slot_mapping.shape, num_tokens)
    if num_tokens == 0:
        return
    _require_runnable(k, v, k_cache, v_cache, slot_mapping)
    block_c = triton.next_power_of_2(num_kv_heads * head_dim)
    block_t = store_tokens_per_program(block_c, INTERPRETED)
    grid = (triton.cdiv(num_tokens, block_t),)
    _store_kv_kernel[grid](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        num_tokens,
        k_cache.shape[1],
        *k.stride(),
        *v.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_T=block_t,
        BLOCK_C=block_c,
        OFFSET_64=needs_64bit_offsets(k, v, k_cache, v_cache),
    )


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float,
    out: torch.Tensor | None = None,
    tiles: AttentionTiles | None = None,
) -> torch.Tensor:
    """Causal attention of packed queries over paged K/V, mixed batches in one launch.

    `q` is `[num_tokens, num_heads, head_dim]`; sequence i owns query tokens
    `query_start_loc[i]:query_start_loc[i+1]`, which are the last positions of
    its `seq_lens[i]` context tokens; query j of sequence i attends to key
    positions `0 .. seq_lens[i] - query_len_i + j`, read through
    `block_tables[i]` (int32, any block size, any physical order). The K/V of
    this step's tokens must already be in the cache (`store_kv`). num_heads
    must be a multiple of num_kv_heads (GQA); head_dim a power of two in
    [16, 256]. Accumulates in float32, or float64 for float64 inputs.
    Returns `out` (allocated like `q` when None).
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    if out is None:
        out = torch.empty_like(q)
    if num_tokens == 0 or num_seqs == 0:
        return out
    _require_runnable(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out)
    assert k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride()
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    assert head_dim == triton.next_power_of_2(head_dim), head_dim
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    if tiles is None:
        tiles = attention_tiles(max_query_len, group, head_dim, q.dtype, INTERPRETED)
    assert tiles.block_m % group_pad == 0 and tiles.block_m >= 16, tiles
    block_q = tiles.block_m // group_pad
    # Sequence i owns flat tiles from query_start_loc[i] // block_q + i on (see _find_seq).
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    fp64 = q.dtype == torch.float64
    # Scalar float arguments reach a kernel as float32; float64 runs add the
    # rounding residual back so their scale stays exact to ~1e-15.
    scale_hi = float32_scale(scale)
    acc_dtype = tl.float64 if fp64 else tl.float32
    # The interpreter's dot is wrong on raw 16-bit floats, so it always gets the
    # accumulation type; a GPU keeps 16-bit operands for the tensor cores.
    if not INTERPRETED and q.dtype in (torch.float16, torch.bfloat16):
        dot_dtype = tl.float16 if q.dtype == torch.float16 else tl.bfloat16
    else:
        dot_dtype = acc_dtype
    _paged_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        seq_lens,
        query_start_loc,
        num_seqs,
        scale_hi,
        scale - scale_hi,
        k_cache.shape[1],
        *q.stride(),
        *out.stride(),
        *k_cache.stride(),
        block_tables.stride(0),
        GROUP=group,
        GROUP_PAD=group_pad,
        HEAD_DIM=head_dim,
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        ACC_DTYPE=acc_dtype,
        DOT_DTYPE=dot_dtype,
        OFFSET_64=needs_64bit_offsets(k_cache),
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    return out
