"""`flash_varlen`: FlashAttention's varlen contract. Queries stay packed (`cu_seqlens_q`), keys
are read through the block table (`cu_seqlens_k`), and the causal diagonal is aligned
bottom-right, so a chunk after a cached prefix needs no extra mask. `impl` picks who runs it:
- `flash_attn`: the flash-attn package (CUDA, fp16/bf16, block size a multiple of 256);
- `torch`: PyTorch's `varlen_attn` on CUDA (fp16/bf16), paged where it takes a block table;
- `sdpa`: SDPA over gathered pages, any device: decodes batched, each prefill chunk alone;
- `cpu`: the C++ paged kernel (`servelab.kernels.cpu_paged`) for decodes and short prompt
  chunks (every query as one decode), SDPA's flash kernel per chunk once a step has a chunk of
  `SDPA_PROMPT_TOKENS` or more; `sdpa`'s paths (logged) where it cannot run; fast on a CPU;
- `reference`: `varlen_attention_reference`, the specification, never chosen by `auto`;
- `auto`: the first of flash_attn, torch, cpu, sdpa whose constraints hold (logged)."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from servelab.contracts.allocator import KVAllocator
from servelab.contracts.attention import AttentionBackend
from servelab.contracts.hookspecs import hookimpl
from servelab.errors import ConfigError
from servelab.kernels import cpu_paged
from servelab.plugins.attention.padded_decode import (
    OneQueryPlan,
    decode_attention,
    plan_one_query_rows,
)
from servelab.plugins.attention.per_request import (
    PerSeqPlan,
    Workspace,
    expand_kv_heads,
    flat_cache,
    per_seq_attention,
    plan_per_seq,
    store_kv,
)
from servelab.plugins.attention.varlen_impls import (
    TorchVarlenCall,
    allocator_name,
    first_usable,
    impl_problems,
    packed_context_slots,
    per_token_tables,
    varlen_attention_reference,
)
from servelab.step.metadata import AttentionMetadata

logger = logging.getLogger(__name__)

IMPLS = ("auto", "flash_attn", "torch", "reference", "sdpa", "cpu")
SDPA_IMPLS = ("sdpa", "cpu")  # impls that plan batched decodes + per-sequence prefill calls
AUTO_ORDER = ("flash_attn", "torch", "cpu", "sdpa")  # what impl=auto tries, fastest first
# impl=cpu: a step with a prompt chunk this long attends its prompt rows through SDPA (a
# blocked GEMM over the chunk): the kernel's one decode per token reads the context once per
# query: level with SDPA at 16 tokens, 2x slower at 32, 2.6-12x at 64-512, 1.7x faster at 8
# (a fresh prompt, Qwen3-0.6B's heads, 2 cores, measured)
SDPA_PROMPT_TOKENS = 16
KernelFn = Callable[..., torch.Tensor]


# -- the backend


@dataclass
class FlashVarlenPlan:
    """Built once per step; every layer reuses it. What only some impls read is
    filled in by `FlashVarlenBackend.complete_plan`, in `plan` once the impl is
    known, else by the step's first layer."""

    meta: AttentionMetadata
    slot_mapping: torch.Tensor  # int64 [num_tokens]
    cu_seqlens_q: torch.Tensor  # int32 [num_seqs + 1]
    cu_seqlens_k: torch.Tensor  # int32 [num_seqs + 1]
    seq_lens: torch.Tensor  # int32 [num_seqs]
    block_table: torch.Tensor  # int32 [num_seqs, max_blocks]
    max_seqlen_q: int
    max_seqlen_k: int
    block_size: int
    num_one_query_seqs: int = 0  # the metadata's: the leading one-query sequences
    completed: bool = False  # the impl-specific fields below are filled in
    context_slots: torch.Tensor | None = None  # impl=torch gathering pages: packed context slots
    one_query: OneQueryPlan | None = None  # impl=sdpa, cpu without its kernel: batched decodes
    prefills: PerSeqPlan | None = None  # impl=sdpa/cpu: one call per prefill chunk
    # impl=cpu with its kernel, a step with prompt tokens: every query token as its
    # own "decode" over the context up to and including it (its sequence's table row)
    token_tables: torch.Tensor | None = None  # int32 [num_tokens, max_blocks]
    token_lens: torch.Tensor | None = None  # int32 [num_tokens]: position + 1
    # impl=cpu, bf16, AVX512-BF16: the rows after the one-query ones, for the prompt
    # kernel (`cpu_paged.paged_prefill_bf16`): their tables, query starts and lengths
    prompt_rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @property
    def decode_only(self) -> bool:
        return self.max_seqlen_q == 1


class FlashVarlenBackend(AttentionBackend):
    """Packed tokens + cu_seqlens + block table: FlashAttention's varlen interface."""

    name: ClassVar[str] = "flash_varlen"
    description: ClassVar[str] = (
        "FlashAttention varlen contract (packed q, cu_seqlens, block table); "
        "impl=auto|flash_attn|torch|cpu|sdpa|reference"
    )

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, impl: str = "auto"
    ) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        if impl not in IMPLS:
            raise ConfigError(
                f"attention backend 'flash_varlen': unknown impl {impl!r}; choose one of {', '.join(IMPLS)}"
            )
        self.impl = impl
        self.active_impl: str | None = None  # what `impl` resolved to, set by check() or first use
        self._torch_call: TorchVarlenCall | None = None
        self._flash_fns: tuple[KernelFn, KernelFn] | None = None  # varlen_func, with_kvcache
        self._decode_kernel = False  # impl=cpu: its C++ kernel runs the decodes
        self._prompt_kernel = False  # impl=cpu, bf16 on AVX512-BF16: and the prompt chunks
        self.workspace = Workspace()  # impl=sdpa: gathered K/V reused across layers and steps
        self.cpu_kernel_calls = 0  # layers the C++ kernel attended (stats())
        self.cpu_prompt_kernel_calls = 0  # layers the bf16 prompt kernel attended

    # -- choosing the impl

    def check(self, allocator: KVAllocator, device: torch.device, dtype: torch.dtype) -> None:
        """Resolves `impl` for this allocator/device/dtype; raises ConfigError
        naming every broken constraint when an explicitly asked impl cannot run."""
        self._select(allocator.block_size, torch.device(device), dtype, allocator_name(allocator))

    def _select(
        self, block_size: int, device: torch.device, dtype: torch.dtype, allocator: str
    ) -> None:
        self._decode_kernel = self._prompt_kernel = False
        if self.impl in ("reference", *SDPA_IMPLS):
            chosen = self.impl
        elif self.impl in ("flash_attn", "torch"):
            problems = impl_problems(self.impl, block_size, device, dtype, self.head_dim)
            if problems:
                raise ConfigError(
                    f"attention backend 'flash_varlen' with impl={self.impl!r} cannot serve "
                    f"allocator {allocator!r} on {device} with {dtype}: " + "; ".join(problems)
                )
            chosen = self.impl
        else:
            chosen, reasons = first_usable(AUTO_ORDER, block_size, device, dtype, self.head_dim)
            logger.info(
                "flash_varlen impl=auto chose %r for %s/%s/block_size=%d%s",
                chosen,
                device,
                dtype,
                block_size,
                f" ({' | '.join(reasons)})" if reasons else "",
            )
        if chosen == "flash_attn":
            from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

            self._flash_fns = (flash_attn_varlen_func, flash_attn_with_kvcache)
        elif chosen == "torch":
            self._torch_call = TorchVarlenCall.inspect(block_size)
        elif chosen == "cpu":
            # built now, with the engine, not inside a timed step
            problems = cpu_paged.problems(device, dtype, self.head_dim)
            self._decode_kernel = not problems
            self._prompt_kernel = (
                not problems and dtype == torch.bfloat16 and cpu_paged.prefill_bf16_available()
            )
            if problems:
                logger.info(
                    "flash_varlen impl='cpu': decodes use SDPA's batched call, not the C++ "
                    "kernel: %s",
                    "; ".join(problems),
                )
        self.active_impl = chosen

    # -- one step

    def plan(self, meta: AttentionMetadata) -> FlashVarlenPlan:
        plan = FlashVarlenPlan(
            meta=meta,
            slot_mapping=meta.slot_mapping,
            cu_seqlens_q=meta.query_start_loc,
            cu_seqlens_k=meta.seq_start_loc,
            seq_lens=meta.seq_lens,
            block_table=meta.block_tables,
            max_seqlen_q=meta.max_query_len,
            max_seqlen_k=meta.max_seq_len,
            block_size=meta.block_size,
            num_one_query_seqs=meta.num_one_query_seqs,
        )
        if self.active_impl is not None:
            self.complete_plan(plan)
        return plan

    def complete_plan(self, plan: FlashVarlenPlan) -> None:
        """Builds what the chosen impl reads beyond the metadata, once per step."""
        meta = plan.meta
        if self.active_impl == "torch":
            assert self._torch_call is not None
            if not self._torch_call.paged:  # pages are gathered into packed K/V first
                plan.context_slots = packed_context_slots(meta)
        elif self.active_impl in SDPA_IMPLS:
            if self._decode_kernel:  # the kernel reads the block table itself
                plan.block_table = plan.block_table.contiguous()
                plan.seq_lens = plan.seq_lens.contiguous()
                num = meta.num_one_query_seqs
                if meta.max_query_len >= SDPA_PROMPT_TOKENS:  # the kernel for those `num` only
                    if self._prompt_kernel:  # and the prompt kernel for the rows after them
                        plan.prompt_rows = (
                            plan.block_table[num:],
                            meta.query_start_loc[num:].contiguous(),
                            plan.seq_lens[num:],
                        )
                    else:
                        plan.prefills = plan_per_seq(meta, first=num)
                elif num < meta.num_tokens:  # short prompt chunks: each token a query
                    plan.token_tables, plan.token_lens = per_token_tables(meta)
            else:
                plan.one_query = plan_one_query_rows(meta, self.num_kv_heads)
                plan.prefills = plan_per_seq(meta, first=meta.num_one_query_seqs)
        plan.completed = True

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        plan: FlashVarlenPlan,
    ) -> torch.Tensor:
        if self.active_impl is None:  # check() was skipped: decide once, from the first layer
            self._select(plan.block_size, q.device, q.dtype, "unknown")
        if not plan.completed:  # planned before the impl was known: once, in the first layer
            self.complete_plan(plan)
        k_cache, v_cache = kv_cache
        if self._decode_kernel and k.dtype == k_cache.dtype:
            cpu_paged.store_kv(k, v, k_cache, v_cache, plan.slot_mapping)  # one call, not two
        else:
            store_kv(k, v, k_cache, v_cache, plan.slot_mapping)
        if self.active_impl in SDPA_IMPLS:
            return self._forward_sdpa(q, k, v, k_cache, v_cache, plan)
        if self.active_impl == "flash_attn":
            return self._forward_flash_attn(q, k_cache, v_cache, plan)
        if self.active_impl == "torch":
            return self._forward_torch(q, k_cache, v_cache, plan)
        return varlen_attention_reference(
            q,
            k_cache,
            v_cache,
            plan.cu_seqlens_q,
            plan.cu_seqlens_k,
            plan.block_table,
            plan.max_seqlen_q,
            plan.max_seqlen_k,
            self.scale,
            causal=True,
        )

    def cpu_paged_kernel_inputs(
        self, plan: FlashVarlenPlan, num_layers: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """impl=cpu with its kernel: a step is `store_kv`, then `paged_decode` over the
        sequences' tables (one query each) or the prompt tokens' own (`token_tables`);
        None for a step with a chunk of `SDPA_PROMPT_TOKENS` or more (SDPA attends it)."""
        if not self._decode_kernel or self.active_impl not in SDPA_IMPLS:
            return None
        if not plan.completed:
            self.complete_plan(plan)
        if plan.prefills is not None or plan.prompt_rows is not None:  # long prompt chunks
            return None
        self.cpu_kernel_calls += num_layers
        return (plan.slot_mapping, *self._kernel_tables(plan))

    @staticmethod
    def _kernel_tables(plan: FlashVarlenPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """What impl=cpu's kernel attends over, one call a layer: the sequences'
        tables when each has one query, else every query token's own
        (`token_tables`, which `complete_plan` builds for such a step)."""
        if plan.num_one_query_seqs == plan.meta.num_tokens:
            return plan.block_table, plan.seq_lens
        assert plan.token_tables is not None and plan.token_lens is not None
        return plan.token_tables, plan.token_lens

    def stats(self) -> dict[str, float]:
        """`cpu_kernel_calls`: layers the C++ decode kernel attended (impl=cpu), for
        decodes and short prompt chunks' tokens alike; `cpu_prompt_kernel_calls`:
        layers the bf16 prompt kernel attended."""
        return {
            "cpu_kernel_calls": self.cpu_kernel_calls,
            "cpu_prompt_kernel_calls": self.cpu_prompt_kernel_calls,
        }

    def _forward_flash_attn(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: FlashVarlenPlan
    ) -> torch.Tensor:
        assert self._flash_fns is not None
        varlen_func, with_kvcache = self._flash_fns
        if plan.decode_only:
            # one query per sequence: [batch, 1, heads, dim]; the cache already holds
            # this step's key, so every sequence attends to seq_lens keys
            out = with_kvcache(
                q.unsqueeze(1),
                k_cache,
                v_cache,
                cache_seqlens=plan.seq_lens,
                block_table=plan.block_table,
                softmax_scale=self.scale,
                causal=True,
            )
            return out.squeeze(1)
        return varlen_func(
            q,
            k_cache,
            v_cache,
            cu_seqlens_q=plan.cu_seqlens_q,
            cu_seqlens_k=plan.cu_seqlens_k,
            max_seqlen_q=plan.max_seqlen_q,
            max_seqlen_k=plan.max_seqlen_k,
            softmax_scale=self.scale,
            causal=True,
            block_table=plan.block_table,
        )

    def _forward_sdpa(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        plan: FlashVarlenPlan,
    ) -> torch.Tensor:
        if self._decode_kernel and plan.prefills is None and plan.prompt_rows is None:
            # one kernel call: the decodes, and short prompt chunks' tokens each over its
            # causal context (its K/V were just stored); it reads the tables' first q rows
            self.cpu_kernel_calls += 1
            tables, lens = self._kernel_tables(plan)
            return cpu_paged.paged_decode(q, k_cache, v_cache, tables, lens, self.scale)
        num = plan.num_one_query_seqs
        if self._decode_kernel:  # one-query rows through the kernel, prompt chunks after them
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous
            if num:
                self.cpu_kernel_calls += 1
                out[:num] = cpu_paged.paged_decode(
                    q[:num], k_cache, v_cache, plan.block_table, plan.seq_lens, self.scale
                )
            if plan.prompt_rows is not None:  # the bf16 prompt kernel (it checks the dtypes)
                self.cpu_prompt_kernel_calls += 1
                rows = plan.prompt_rows
                cpu_paged.paged_prefill_bf16(q, k_cache, v_cache, *rows, self.scale, out)
                return out
            return per_seq_attention(
                q, k, v, k_cache, v_cache, plan.prefills, self.scale, out, self.workspace
            )
        if num == q.shape[0]:  # one query per sequence: one call, nothing to assemble
            return self._decode(q, k_cache, v_cache, plan)
        out = torch.empty_like(q)
        if num:
            out[:num] = self._decode(q[:num], k_cache, v_cache, plan)
        return per_seq_attention(
            q, k, v, k_cache, v_cache, plan.prefills, self.scale, out, self.workspace
        )

    def _decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: FlashVarlenPlan
    ) -> torch.Tensor:
        """The step's leading one-query sequences, batched through SDPA."""
        return decode_attention(q, k_cache, v_cache, plan.one_query, self.scale, self.workspace)

    def _forward_torch(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: FlashVarlenPlan
    ) -> torch.Tensor:
        call = self._torch_call
        assert call is not None
        kwargs: dict[str, Any] = dict(call.causal_kwargs)
        if call.has_scale:
            kwargs["scale"] = self.scale
        else:  # the kernel applies 1/sqrt(head_dim); fold our scale into q
            q = q * (self.scale * math.sqrt(self.head_dim))
        grouped = self.num_heads != self.num_kv_heads
        if grouped and call.has_gqa:
            kwargs["enable_gqa"] = True
        if call.paged:
            keys, values = k_cache, v_cache
            kwargs["block_table"] = plan.block_table
            kwargs["seqused_k"] = plan.seq_lens
        else:
            assert plan.context_slots is not None, "plan() ran before the torch impl was chosen"
            keys = flat_cache(k_cache)[plan.context_slots]
            values = flat_cache(v_cache)[plan.context_slots]
            if grouped and not call.has_gqa:
                ratio = self.num_heads // self.num_kv_heads
                keys = expand_kv_heads(keys, ratio, dim=1)
                values = expand_kv_heads(values, ratio, dim=1)
        return call.fn(
            q,
            keys,
            values,
            plan.cu_seqlens_q,
            plan.cu_seqlens_k,
            plan.max_seqlen_q,
            plan.max_seqlen_k,
            **kwargs,
        )


@hookimpl
def servelab_register_attention_backends() -> dict[str, type[AttentionBackend]]:
    return {FlashVarlenBackend.name: FlashVarlenBackend}
