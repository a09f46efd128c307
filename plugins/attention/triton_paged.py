"""`triton_paged`: our own Triton kernels read K/V straight through the block
table; one launch stores the step's K/V, one launch attends the whole mixed
batch (prefill chunks and decodes alike).

The kernels module is imported on first use, not when plugins load: importing
it on a machine without CUDA sets `TRITON_INTERPRET=1` for the process (see
`triton_kernels`), which only a run that picks this backend should do.
"""

from __future__ import annotations

import functools
import importlib
import logging
from dataclasses import dataclass, field
from types import ModuleType
from typing import ClassVar

import torch

from servelab.contracts.allocator import KVAllocator
from servelab.contracts.attention import AttentionBackend
from servelab.contracts.hookspecs import hookimpl
from servelab.errors import ConfigError
from servelab.step.metadata import AttentionMetadata

NAME = "triton_paged"
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256


log = logging.getLogger(__name__)
INTERPRETED_WARNING = (
    "servelab: attention=triton_paged on a CPU runs its kernels in the Triton interpreter, "
    "about 4 output tokens/s on the tiny model (a workload takes minutes); on a CPU, "
    "attention=flash_varlen or per_request serve the same tokens in seconds"
)


@functools.cache
def warn_interpreted() -> None:
    """Says once per process that the kernels will be interpreted, and how slow that is."""
    log.warning(INTERPRETED_WARNING)


@functools.cache
def kernels() -> ModuleType:
    """The Triton kernels module (imported, and its interpreter mode decided, on first call)."""
    return importlib.import_module("servelab.plugins.attention.triton_kernels")


@dataclass
class TritonPagedPlan:
    """One step's kernel arguments; the tile shape is picked once per dtype."""

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_query_len: int
    group_size: int
    head_dim: int
    _tiles: dict = field(default_factory=dict)

    def tiles(self, dtype: torch.dtype):
        if dtype not in self._tiles:
            module = kernels()
            self._tiles[dtype] = module.attention_tiles(
                self.max_query_len, self.group_size, self.head_dim, dtype, module.INTERPRETED
            )
        return self._tiles[dtype]


class TritonPagedBackend(AttentionBackend):
    """Paged attention with our own Triton kernels (KV store + one mixed-batch kernel).

    Serves any block size (1 up to one block of max_model_len, so both
    allocators), GQA with num_heads a multiple of num_kv_heads, head_dim a
    power of two in [16, 256], float16/bfloat16/float32/float64 (float64
    accumulates in float64), on CUDA or, interpreted, on the CPU.
    """

    description: ClassVar[str] = (
        "own Triton kernels: paged KV store + one attention kernel for mixed prefill/decode batches"
    )
    graph_safe: ClassVar[bool] = True  # device-tensor plan, no host sync, skips negative slots

    def check(self, allocator: KVAllocator, device: torch.device, dtype: torch.dtype) -> None:
        hd = self.head_dim
        if not (MIN_HEAD_DIM <= hd <= MAX_HEAD_DIM and hd & (hd - 1) == 0):
            raise ConfigError(
                f"attention backend '{NAME}' needs head_dim to be a power of two in "
                f"[{MIN_HEAD_DIM}, {MAX_HEAD_DIM}], got head_dim={hd}"
            )
        if self.num_heads % self.num_kv_heads != 0:
            raise ConfigError(
                f"attention backend '{NAME}' needs num_heads to be a multiple of num_kv_heads, "
                f"got num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}"
            )
        if dtype not in SUPPORTED_DTYPES:
            names = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
            raise ConfigError(
                f"attention backend '{NAME}' supports dtype {names}, got dtype={dtype}"
            )
        device = torch.device(device)
        if device.type not in ("cpu", "cuda"):
            raise ConfigError(
                f"attention backend '{NAME}' runs on device cuda (compiled) or cpu "
                f"(interpreted), got device={device}"
            )
        if device.type == "cpu" and not kernels().INTERPRETED:
            raise ConfigError(
                f"attention backend '{NAME}' on device=cpu needs the Triton interpreter: set "
                "TRITON_INTERPRET=1 before servelab.plugins.attention.triton_kernels is imported"
            )
        if device.type == "cpu":
            warn_interpreted()

    def plan(self, meta: AttentionMetadata) -> TritonPagedPlan:
        return TritonPagedPlan(
            slot_mapping=meta.slot_mapping,
            block_tables=meta.block_tables,
            seq_lens=meta.seq_lens,
            query_start_loc=meta.query_start_loc,
            max_query_len=meta.max_query_len,
            group_size=self.num_heads // self.num_kv_heads,
            head_dim=self.head_dim,
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        plan: TritonPagedPlan,
    ) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        ops = kernels()
        ops.store_kv(k, v, k_cache, v_cache, plan.slot_mapping)
        return ops.paged_attention(
            q,
            k_cache,
            v_cache,
            plan.block_tables,
            plan.seq_lens,
            plan.query_start_loc,
            plan.max_query_len,
            self.scale,
            tiles=plan.tiles(q.dtype),
        )


@hookimpl
def servelab_register_attention_backends() -> dict[str, type]:
    return {NAME: TritonPagedBackend}
