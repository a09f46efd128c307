"""Decode CUDA graphs: a small model's decode step is bound by the launch gaps of a few
hundred small kernels, so one decode-only forward per batch-size bucket is captured.

Rules:
- only graph-safe backends are captured: `plan` reads only the metadata's device tensors,
  `forward` never syncs with the host, the KV store skips negative slots (`PAD_SLOT` rows);
- a step whose sequences all have one query token replays the smallest bucket that holds it;
  anything else (or a batch above the largest bucket) runs eagerly through the same `forward`;
- a replay returns a view of the graph's output buffer, overwritten by the next replay of
  that bucket: consume it within the step.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from servelab.step.metadata import AttentionMetadata

log = logging.getLogger(__name__)

PAD_SLOT = -1  # the slot padding rows store their K/V at: negative, so nowhere
SMALL_BUCKETS = (1, 2, 4, 8)
BUCKET_STEP = 16

Forward = Callable[[torch.Tensor, torch.Tensor, Any], torch.Tensor]


def graph_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """Batch sizes to capture: 1, 2, 4, 8, then every multiple of 16, and
    `max_num_seqs` itself, none above it."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = {b for b in SMALL_BUCKETS if b < max_num_seqs}
    sizes.update(range(BUCKET_STEP, max_num_seqs, BUCKET_STEP))
    sizes.add(max_num_seqs)
    return tuple(sorted(sizes))


def pick_bucket(buckets: Sequence[int], num_seqs: int) -> int | None:
    """The smallest bucket >= `num_seqs` (buckets sorted), None when none holds it."""
    i = bisect.bisect_left(buckets, num_seqs)
    return buckets[i] if i < len(buckets) else None


def backend_is_graph_safe(backend: Any) -> bool:
    """The backend's `graph_safe` flag (see `AttentionBackend.graph_safe`)."""
    return bool(getattr(backend, "graph_safe", False))


@dataclass
class StaticDecodeInputs:
    """The buffers every captured graph reads, sized for the largest bucket.
    Bucket `b` uses the first `b` rows (and `b + 1` cumulative entries)."""

    input_ids: torch.Tensor  # int64 [max_batch]
    positions: torch.Tensor  # int64 [max_batch]
    slot_mapping: torch.Tensor  # int64 [max_batch]
    seq_lens: torch.Tensor  # int32 [max_batch]
    context_lens: torch.Tensor  # int32 [max_batch]
    query_start_loc: torch.Tensor  # int32 [max_batch + 1]: 0, 1, 2, ... (one query each)
    seq_start_loc: torch.Tensor  # int32 [max_batch + 1]
    block_tables: torch.Tensor  # int32 [max_batch, max_blocks_per_seq]
    logits_indices: torch.Tensor  # int64 [max_batch]: 0, 1, 2, ...

    @classmethod
    def allocate(
        cls, max_batch: int, max_blocks_per_seq: int, device: torch.device
    ) -> StaticDecodeInputs:
        i32 = dict(dtype=torch.int32, device=device)
        i64 = dict(dtype=torch.int64, device=device)
        return cls(
            input_ids=torch.zeros(max_batch, **i64),
            positions=torch.zeros(max_batch, **i64),
            slot_mapping=torch.full((max_batch,), PAD_SLOT, **i64),
            seq_lens=torch.ones(max_batch, **i32),
            context_lens=torch.zeros(max_batch, **i32),
            query_start_loc=torch.arange(max_batch + 1, **i32),
            seq_start_loc=torch.arange(max_batch + 1, **i32),  # cumsum of the ones
            block_tables=torch.zeros(max_batch, max_blocks_per_seq, **i32),
            logits_indices=torch.arange(max_batch, **i64),
        )

    def metadata(self, batch: int, block_size: int, max_model_len: int) -> AttentionMetadata:
        """Metadata over the first `batch` rows. Its `*_cpu` lists describe the
        padding state only: a graph-safe backend never reads them."""
        return AttentionMetadata(
            num_seqs=batch,
            num_one_query_seqs=batch,
            num_tokens=batch,
            block_size=block_size,
            query_start_loc=self.query_start_loc[: batch + 1],
            seq_start_loc=self.seq_start_loc[: batch + 1],
            seq_lens=self.seq_lens[:batch],
            context_lens=self.context_lens[:batch],
            block_tables=self.block_tables[:batch],
            slot_mapping=self.slot_mapping[:batch],
            positions=self.positions[:batch],
            logits_indices=self.logits_indices[:batch],
            query_lens_cpu=[1] * batch,
            seq_lens_cpu=[1] * batch,
            max_query_len=1,
            max_seq_len=max_model_len,  # an upper bound, for kernels that size launches by it
        )

    def load(self, input_ids: torch.Tensor, meta: AttentionMetadata, batch: int) -> None:
        """Copies a one-query step (`meta.num_seqs` rows) into the first rows and
        pads the rest up to `batch`; device-side copies only, no host sync."""
        n = meta.num_seqs
        width = meta.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(meta.positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        # Columns past `width` keep older block ids: valid ids, never read, since a
        # kernel reads only the blocks below its row's seq_len.
        self.block_tables[:n, :width].copy_(meta.block_tables, non_blocking=True)
        if batch > n:
            self.input_ids[n:batch].zero_()
            self.positions[n:batch].zero_()
            self.slot_mapping[n:batch].fill_(PAD_SLOT)
            self.seq_lens[n:batch].fill_(1)
        torch.sub(self.seq_lens[:batch], 1, out=self.context_lens[:batch])
        torch.cumsum(
            self.seq_lens[:batch], 0, dtype=torch.int32, out=self.seq_start_loc[1 : batch + 1]
        )


class DecodeGraphRunner:
    """Runs decode forwards through captured CUDA graphs where it can, eagerly
    where it cannot.

    `forward(input_ids, positions, attn_plan) -> hidden [num_tokens, hidden]` is
    the model's forward with the KV cache and backend bound, e.g.
    `lambda ids, pos, plan: model(ids, pos, kv_cache.layers, backend, plan)`.

    `enabled=False`, a non-CUDA device or a backend that is not graph-safe make
    every call eager (`disabled_reason` says why); `capture()` then does nothing.
    """

    def __init__(
        self,
        forward: Forward,
        backend: Any,
        *,
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        device: torch.device | str,
        enabled: bool = True,
        buckets: Sequence[int] | None = None,
    ) -> None:
        self.forward = forward
        self.backend = backend
        self.device = torch.device(device)
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.buckets = tuple(sorted(set(buckets))) if buckets else graph_buckets(max_num_seqs)
        self.max_batch = self.buckets[-1]
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.disabled_reason = self._why_disabled(enabled)
        self.static = StaticDecodeInputs.allocate(
            self.max_batch, self.max_blocks_per_seq, self.device
        )
        self.graphs: dict[int, Any] = {}  # bucket -> torch.cuda.CUDAGraph
        self._outputs: dict[int, torch.Tensor] = {}
        self._plans: dict[int, Any] = {}  # kept alive: a graph reads what its plan points at
        self._pool: Any = None
        self.num_replays = 0
        self.num_eager = 0

    @property
    def enabled(self) -> bool:
        return self.disabled_reason is None

    def _why_disabled(self, enabled: bool) -> str | None:
        if not enabled:
            return "CUDA graphs are off (engine.cuda_graphs=false)"
        if not self._device_has_graphs():
            return f"CUDA graphs need a CUDA device, got {self.device}"
        if not backend_is_graph_safe(self.backend):
            name = getattr(self.backend, "name", type(self.backend).__name__)
            return (
                f"attention backend {name!r} is not graph-safe (it reads host-side metadata, "
                "syncs with the host or cannot skip padding slots): decode runs eagerly"
            )
        return None

    def _device_has_graphs(self) -> bool:
        return self.device.type == "cuda"

    # -- capture

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures one graph per bucket, largest first so the smaller ones reuse
        its memory pool. Each bucket runs once eagerly first, so kernels compile
        and allocators warm up outside the capture. Padding-only inputs: the
        capture writes no KV."""
        if not self.enabled:
            log.info("decode CUDA graphs not captured: %s", self.disabled_reason)
            return
        for batch in reversed(self.buckets):
            meta = self.static.metadata(batch, self.block_size, self.max_model_len)
            plan = self.backend.plan(meta)
            ids, positions = self.static.input_ids[:batch], self.static.positions[:batch]
            self.forward(ids, positions, plan)  # warm-up: compile outside the capture
            self.graphs[batch], self._outputs[batch] = self._capture_graph(ids, positions, plan)
            self._plans[batch] = plan
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        log.info("captured decode CUDA graphs for batch sizes %s", list(self.buckets))

    def _capture_graph(
        self, input_ids: torch.Tensor, positions: torch.Tensor, plan: Any
    ) -> tuple[Any, torch.Tensor]:
        """One graph of `forward(input_ids, positions, plan)` in the shared pool:
        `(graph, its output buffer)`; `graph.replay()` reruns it on whatever the
        static inputs hold then."""
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self.forward(input_ids, positions, plan)
        if self._pool is None:
            self._pool = graph.pool()
        return graph, out

    # -- one step

    def bucket_for(self, meta: AttentionMetadata) -> int | None:
        """The captured bucket this step replays, None when it must run eagerly."""
        if not self.graphs or meta.num_tokens != meta.num_seqs:
            return None
        if meta.block_tables.shape[1] > self.max_blocks_per_seq:
            return None
        batch = pick_bucket(self.buckets, meta.num_seqs)
        return batch if batch in self.graphs else None

    def run(
        self, input_ids: torch.Tensor, meta: AttentionMetadata, attn_plan: Any = None
    ) -> torch.Tensor:
        """Hidden states `[num_tokens, hidden]` of one step: a graph replay for a
        one-query step (one query token per sequence) that fits a bucket, else the eager forward (with `attn_plan`,
        or a plan made here when the caller has none)."""
        batch = self.bucket_for(meta)
        if batch is None:
            self.num_eager += 1
            plan = attn_plan if attn_plan is not None else self.backend.plan(meta)
            return self.forward(input_ids, meta.positions, plan)
        self.static.load(input_ids, meta, batch)
        self.graphs[batch].replay()
        self.num_replays += 1
        return self._outputs[batch][: meta.num_seqs]

    def run_padded_eager(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """What a replay computes, run eagerly on any device: the step is loaded
        into the static buffers, padded to its bucket and run with a plan over
        them. Tests and debugging use it to check padding without a GPU."""
        if meta.num_tokens != meta.num_seqs:
            raise ValueError("run_padded_eager takes decode steps only (one query per sequence)")
        batch = pick_bucket(self.buckets, meta.num_seqs)
        if batch is None:
            raise ValueError(f"batch {meta.num_seqs} exceeds the largest bucket {self.max_batch}")
        self.static.load(input_ids, meta, batch)
        static_meta = self.static.metadata(batch, self.block_size, self.max_model_len)
        plan = self.backend.plan(static_meta)
        out = self.forward(self.static.input_ids[:batch], self.static.positions[:batch], plan)
        return out[: meta.num_seqs]
