"""What `flash_varlen`'s impls need, and the contract itself in plain torch.

`varlen_attention_reference` is FlashAttention's paged varlen attention spelled
out op by op: the specification every impl is tested against, and impl
`reference`. The `*_problems` functions list every constraint of an impl a
configuration breaks, so `impl=auto` can say why it passed one over.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from servelab.contracts.allocator import KVAllocator
from servelab.kernels import cpu_paged
from servelab.plugins.attention.per_request import expand_kv_heads, packed_slots_of
from servelab.step.metadata import AttentionMetadata

HALF_DTYPES = (torch.float16, torch.bfloat16)
# FlashAttention-2 reads a paged cache only when a page holds a multiple of 256 tokens.
FLASH_PAGE_MULTIPLE = 256


# -- the contract, in plain torch


def varlen_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    block_table: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float,
    causal: bool = True,
    seqused_k: torch.Tensor | None = None,
) -> torch.Tensor:
    """FlashAttention's paged varlen attention, spelled out in plain torch.

    - `q`: `[total_q, num_heads, head_dim]`, sequence i owns rows
      `cu_seqlens_q[i]:cu_seqlens_q[i+1]`;
    - `k_cache`, `v_cache`: `[num_blocks, block_size, num_kv_heads, head_dim]`;
      sequence i's key `p` is at `block_table[i, p // block_size]`, offset
      `p % block_size`; it has `cu_seqlens_k[i+1] - cu_seqlens_k[i]` keys, or
      `seqused_k[i]` when given (as in FlashAttention);
    - `num_heads` a multiple of `num_kv_heads`: query head h reads KV head
      `h // (num_heads // num_kv_heads)`;
    - `causal`: bottom-right aligned, query j of a sequence with `lq` queries
      and `lk` keys sees keys `0 .. lk - lq + j`; a query that sees no key
      (only when `lq > lk`) outputs zeros, as FlashAttention does.

    `max_seqlen_q`/`max_seqlen_k` are accepted for signature parity and checked.
    Scores are computed in float32 (float64 for float64 inputs); the output has
    `q`'s dtype. This syncs with the host (it loops over sequences in Python):
    it is the specification and the CPU implementation, not a fast path.
    """
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    block_size = k_cache.shape[1]
    compute_dtype = torch.promote_types(q.dtype, torch.float32)
    starts_q = cu_seqlens_q.tolist()
    if seqused_k is not None:
        lens_k = seqused_k.tolist()
    else:
        starts_k = cu_seqlens_k.tolist()
        lens_k = [b - a for a, b in zip(starts_k[:-1], starts_k[1:], strict=True)]
    out = torch.zeros_like(q)
    for i, len_k in enumerate(lens_k):
        q_i = q[starts_q[i] : starts_q[i + 1]].to(compute_dtype)
        len_q = q_i.shape[0]
        assert len_q <= max_seqlen_q and len_k <= max_seqlen_k, "max_seqlen_q/k below a real length"
        if len_q == 0:
            continue
        num_pages = -(-len_k // block_size)
        pages = block_table[i, :num_pages].long()
        k_i = k_cache[pages].reshape(-1, num_kv_heads, k_cache.shape[-1])[:len_k]
        v_i = v_cache[pages].reshape(-1, num_kv_heads, v_cache.shape[-1])[:len_k]
        k_i = expand_kv_heads(k_i.to(compute_dtype), num_heads // num_kv_heads, dim=1)
        v_i = expand_kv_heads(v_i.to(compute_dtype), num_heads // num_kv_heads, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q_i, k_i) * scale
        if causal:
            query_pos = torch.arange(len_q, device=q.device).view(-1, 1) + (len_k - len_q)
            allowed = torch.arange(len_k, device=q.device).view(1, -1) <= query_pos
            scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows with no key -> 0
        out[starts_q[i] : starts_q[i + 1]] = torch.einsum("hqk,khd->qhd", probs, v_i).to(q.dtype)
    return out


# -- what each impl needs


def allocator_name(allocator: KVAllocator) -> str:
    return getattr(allocator, "name", type(allocator).__name__)


def flash_attn_problems(block_size: int, device: torch.device, dtype: torch.dtype) -> list[str]:
    """Every constraint of impl='flash_attn' this configuration breaks (empty: usable)."""
    problems = []
    try:
        importlib.import_module("flash_attn")
    except Exception as exc:  # ImportError, or a broken CUDA build raising OSError
        problems.append(f"the flash_attn package must be importable (import failed: {exc})")
    if device.type != "cuda":
        problems.append(f"the device must be CUDA (got {device})")
    if dtype not in HALF_DTYPES:
        problems.append(f"the dtype must be float16 or bfloat16 (got {dtype})")
    if block_size % FLASH_PAGE_MULTIPLE != 0:
        problems.append(
            f"the allocator's block_size must be a multiple of {FLASH_PAGE_MULTIPLE} "
            f"(got block_size={block_size})"
        )
    return problems


def torch_varlen_problems(device: torch.device, dtype: torch.dtype) -> list[str]:
    """Every constraint of impl='torch' this configuration breaks (empty: usable)."""
    problems = []
    if _torch_varlen_attn() is None:
        problems.append(
            f"torch.nn.attention.varlen.varlen_attn must exist (torch {torch.__version__} lacks it)"
        )
    if device.type != "cuda":
        problems.append(f"the device must be CUDA (got {device})")
    if dtype not in HALF_DTYPES:
        problems.append(f"the dtype must be float16 or bfloat16 (got {dtype})")
    return problems


def impl_problems(
    impl: str, block_size: int, device: torch.device, dtype: torch.dtype, head_dim: int
) -> list[str]:
    """Every constraint of `impl` this configuration breaks (empty: it can run)."""
    if impl == "flash_attn":
        return flash_attn_problems(block_size, device, dtype)
    if impl == "torch":
        return torch_varlen_problems(device, dtype)
    if impl == "cpu":
        return cpu_paged.problems(device, dtype, head_dim)
    return []  # sdpa: any device, any dtype


def first_usable(
    order: tuple[str, ...], block_size: int, device: torch.device, dtype: torch.dtype, head_dim: int
) -> tuple[str, list[str]]:
    """impl=auto: the first impl of `order` whose constraints hold, and why each
    earlier one did not."""
    reasons = []
    for candidate in order:
        problems = impl_problems(candidate, block_size, device, dtype, head_dim)
        if not problems:
            return candidate, reasons
        reasons.append(f"not {candidate}: {'; '.join(problems)}")
    raise AssertionError("impl='sdpa' serves every configuration")  # the order ends with it


def _torch_varlen_attn() -> Callable[..., torch.Tensor] | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


@dataclass(frozen=True)
class TorchVarlenCall:
    """How to call this torch's `varlen_attn`; its signature grew over releases:
    2.9 `is_causal`, 2.10 `scale`/`window_size`, 2.12 `enable_gqa`/`seqused_k`/`block_table`."""

    fn: Callable[..., torch.Tensor]
    causal_kwargs: dict[str, Any]  # window_size=(-1, 0) or is_causal=True
    has_scale: bool
    has_gqa: bool
    paged: bool  # reads the cache through block_table (else pages are gathered first)

    @classmethod
    def inspect(cls, block_size: int) -> TorchVarlenCall:
        fn = _torch_varlen_attn()
        assert fn is not None
        params = inspect.signature(fn).parameters
        causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
        paged = "block_table" in params and block_size % FLASH_PAGE_MULTIPLE == 0
        return cls(fn, causal, "scale" in params, "enable_gqa" in params, paged)


def per_token_tables(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query token's block-table row (its sequence's) and causal context
    length (its position + 1): the C++ kernel then treats every token of a
    mixed or prompt step as one query over the keys it may see."""
    query_lens = meta.query_start_loc.diff()
    owner = torch.repeat_interleave(
        torch.arange(meta.num_seqs, device=query_lens.device), query_lens
    )
    tables = meta.block_tables.index_select(0, owner).contiguous()
    return tables, (meta.positions + 1).to(torch.int32)


def packed_context_slots(meta: AttentionMetadata) -> torch.Tensor:
    """Slots of every sequence's whole context, packed like the keys of a varlen
    kernel: sequence i owns entries `seq_start_loc[i]:seq_start_loc[i+1]`."""
    return packed_slots_of(meta, list(range(meta.num_seqs)))
