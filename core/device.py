"""CUDA helpers the engine's device path uses: how much memory the KV cache may
take (`gpu_memory_utilization`), and pinned staging buffers that move a step's
metadata to the device in one copy.

Rules:
- KV budget = total device memory x utilization - weights - activation peak.
  A budget <= 0 is a `ConfigError` naming every number; when other processes
  hold memory, the budget shrinks to what is actually free (with a warning);
- everything here that only does arithmetic runs on any machine, so the CPU
  tests cover it; reading the device (`read_device_memory`, the one function
  that does, and `profile_peak_bytes`) needs CUDA, and on any other device it
  is a ConfigError that names the alternative, `kv_cache_memory`;
- `StepStaging` pins its host buffer only for a CUDA device; on a CPU device
  the "device" buffer is the host buffer itself and `upload` copies nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from servelab.errors import ConfigError
from servelab.model.config import ModelConfig, resolve_dtype

log = logging.getLogger(__name__)

GiB = 1024**3


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


# -- what the KV cache may take


@dataclass(frozen=True)
class MemoryBudget:
    """The figures a KV budget is computed from, kept so errors and logs can show them."""

    total_bytes: int
    utilization: float
    weights_bytes: int
    activation_peak_bytes: int
    free_bytes: int | None = None  # free device memory now (after the weights), if known

    @property
    def allowed_bytes(self) -> int:
        """What the engine may use in all: total x utilization."""
        return int(self.total_bytes * self.utilization)

    @property
    def kv_bytes(self) -> int:
        """The KV budget: allowed - weights - activation peak, capped by what is free
        (the activations still have to fit next to the cache). Raises ConfigError when <= 0."""
        budget = self.allowed_bytes - self.weights_bytes - self.activation_peak_bytes
        if budget <= 0:
            raise ConfigError(
                f"gpu_memory_utilization={self.utilization} of {_gib(self.total_bytes)} total "
                f"allows {_gib(self.allowed_bytes)}, which leaves no room for the KV cache: "
                f"weights take {_gib(self.weights_bytes)} and the activation peak "
                f"{_gib(self.activation_peak_bytes)}; raise gpu_memory_utilization, or lower "
                "max_num_batched_tokens / max_num_seqs"
            )
        if self.free_bytes is not None:
            room = self.free_bytes - self.activation_peak_bytes
            if room <= 0:
                raise ConfigError(
                    f"only {_gib(self.free_bytes)} of device memory is free, less than the "
                    f"activation peak {_gib(self.activation_peak_bytes)}: another process holds "
                    "the memory; free it or lower max_num_batched_tokens / max_num_seqs"
                )
            if room < budget:
                log.warning(
                    "KV cache budget cut from %s to %s: only %s is free (another process "
                    "holds device memory)",
                    _gib(budget),
                    _gib(room),
                    _gib(self.free_bytes),
                )
                budget = room
        return budget


def kv_cache_budget(
    total_bytes: int,
    utilization: float,
    weights_bytes: int,
    activation_peak_bytes: int,
    free_bytes: int | None = None,
) -> int:
    """KV bytes: `total_bytes * utilization - weights_bytes - activation_peak_bytes`,
    at most `free_bytes - activation_peak_bytes` when `free_bytes` is given.
    `utilization` is a fraction in (0, 1]; a budget <= 0 is a ConfigError."""
    check_utilization(utilization)
    return MemoryBudget(
        total_bytes, utilization, weights_bytes, activation_peak_bytes, free_bytes
    ).kv_bytes


def check_utilization(utilization: float) -> None:
    if isinstance(utilization, bool) or not isinstance(utilization, (int, float)):
        raise ConfigError(f"gpu_memory_utilization must be a number in (0, 1], got {utilization!r}")
    if not 0.0 < utilization <= 1.0:
        raise ConfigError(
            f"gpu_memory_utilization is the fraction of device memory the engine may use, "
            f"in (0, 1]; got {utilization}"
        )


@dataclass(frozen=True)
class DeviceMemory:
    """One reading of a device's memory."""

    total_bytes: int
    free_bytes: int  # free on the device, whoever holds the rest
    allocated_bytes: int  # what this process's torch allocator holds on it


def read_device_memory(device: torch.device | str) -> DeviceMemory:
    """The one place the device's memory is read (tests replace it with made-up
    figures). Only a CUDA device has memory to size a KV cache from."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ConfigError(
            f"gpu_memory_utilization sizes the KV cache from a CUDA device's memory; on "
            f"device={device.type} set kv_cache_memory instead (and leave "
            "gpu_memory_utilization null)"
        )
    free, total = torch.cuda.mem_get_info(device)
    return DeviceMemory(total, free, torch.cuda.memory_allocated(device))


def allocated_before_weights(device: torch.device | str) -> int:
    """What torch already holds on the device, read before the weights load so
    it is not counted as weights; a non-CUDA device is a ConfigError here,
    before any loading."""
    return read_device_memory(device).allocated_bytes


def device_memory_budget(
    device: torch.device | str,
    utilization: float,
    activation_peak_bytes: int,
    allocated_before: int = 0,
) -> MemoryBudget:
    """Reads the device after the weights are loaded: total and free memory, and
    the weights as what torch allocated on it since `allocated_before` (a
    `read_device_memory` taken before loading; 0 counts everything allocated)."""
    check_utilization(utilization)
    now = read_device_memory(device)
    return MemoryBudget(
        total_bytes=now.total_bytes,
        utilization=utilization,
        weights_bytes=max(0, now.allocated_bytes - allocated_before),
        activation_peak_bytes=activation_peak_bytes,
        free_bytes=now.free_bytes,
    )


def profile_peak_bytes(run: Callable[[], object], device: torch.device | str) -> int:
    """Bytes `run()` allocates at its peak above what was allocated before it (CUDA).
    The engine calls it with a forward of its largest batch to size activations."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ConfigError(f"profiling device memory needs a CUDA device, got {device}")
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    run()
    torch.cuda.synchronize(device)
    return max(0, torch.cuda.max_memory_allocated(device) - before)


# -- estimates from the model's shape (no device needed)


def model_weight_bytes(config: ModelConfig, dtype: str | torch.dtype) -> int:
    """Bytes of every parameter of `Transformer(config, dtype)` (tied embeddings once)."""
    h, d, inner = config.hidden_size, config.head_dim, config.intermediate_size
    q_size, kv_size = config.num_heads * d, config.num_kv_heads * d
    per_layer = h * q_size + 2 * h * kv_size + q_size * h  # q, k, v, o projections
    per_layer += 3 * h * inner  # gate, up, down
    per_layer += 2 * h  # input and post-attention norms
    if config.attention_bias:
        per_layer += q_size + 2 * kv_size
    if config.o_proj_bias:
        per_layer += h
    if config.qk_norm:
        per_layer += 2 * d
    count = config.vocab_size * h + config.num_layers * per_layer + h  # + final norm
    if not config.tie_word_embeddings:
        count += config.vocab_size * h
    return count * _itemsize(dtype)


def estimate_activation_bytes(
    config: ModelConfig,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    dtype: str | torch.dtype,
    headroom: float = 1.5,
) -> int:
    """A rough peak of one forward + sampling step, for sizing before profiling is
    possible: one layer's live tensors for `max_num_batched_tokens` tokens
    (residual, norm output, q/k/v, attention output, RoPE copies, four MLP
    intermediates, float32 norm temporaries) plus float32 logits and sampling
    copies for `max_num_seqs` rows, times `headroom` for backend workspaces and
    allocator slack. Use `profile_peak_bytes` where a dummy forward can run."""
    item = _itemsize(dtype)
    h, inner = config.hidden_size, config.intermediate_size
    q_size = config.num_heads * config.head_dim
    kv_size = config.num_kv_heads * config.head_dim
    per_token = item * (3 * h + 3 * q_size + 4 * kv_size + 4 * inner) + 4 * 2 * h
    logits = max_num_seqs * config.vocab_size * (item + 3 * 4)
    return int(headroom * (max_num_batched_tokens * per_token + logits))


def _itemsize(dtype: str | torch.dtype) -> int:
    return resolve_dtype(dtype).itemsize


# -- step metadata: pinned staging, one copy per step


class StepStaging:
    """Owns a host buffer (pinned for a CUDA device) and a device buffer of
    the same size. A step packs its metadata fields into the host buffer
    (`put`, or `host_view` to fill in place), then `upload` moves the used bytes
    with one non-blocking copy and returns typed device views.

    Rules:
    - fields are packed in `put` order, each aligned to `ALIGN` bytes, so every
      typed view is legal;
    - views returned by `upload` stay valid until the next `begin`: the next step
      reuses the buffers (on CUDA the copy and the kernels that read the views
      run in stream order, so reuse is safe for device work);
    - `begin` waits for the previous upload's copy to finish before the host
      buffer is written again (a pinned source must not change mid-copy);
    - the buffers grow (power of two) when a step needs more than they hold.
    """

    ALIGN = 16

    def __init__(self, device: torch.device | str, capacity_bytes: int = 1 << 16) -> None:
        self.device = torch.device(device)
        self.on_cuda = self.device.type == "cuda"
        self._fields: list[tuple[str, int, int, torch.dtype]] = []  # name, offset, numel, dtype
        self._cursor = 0
        self._copy_done: torch.cuda.Event | None = None
        self.views: dict[str, torch.Tensor] = {}  # the last upload's device views, by name
        self._allocate(max(capacity_bytes, self.ALIGN))

    @property
    def capacity_bytes(self) -> int:
        return self.host.numel()

    @property
    def used_bytes(self) -> int:
        return self._cursor

    def _allocate(self, capacity: int) -> None:
        # pinned: the only host memory a copy can read while the host runs on
        self.host = torch.empty(capacity, dtype=torch.uint8, pin_memory=self.on_cuda)
        if self.on_cuda:
            self.device_buffer = torch.empty(capacity, dtype=torch.uint8, device=self.device)
        else:
            self.device_buffer = self.host

    def begin(self) -> None:
        """Starts a new step: forgets the fields, waits until the last copy is done."""
        if self._copy_done is not None:
            self._copy_done.synchronize()
            self._copy_done = None
        self._fields.clear()
        self.views = {}
        self._cursor = 0

    def host_view(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Reserves field `name` and returns its host tensor view to fill in place
        (`.numpy()` gives a numpy view of the same bytes)."""
        itemsize = dtype.itemsize
        offset = -(-self._cursor // self.ALIGN) * self.ALIGN
        end = offset + numel * itemsize
        if end > self.capacity_bytes:
            self._grow(end)
        self._fields.append((name, offset, numel, dtype))
        self._cursor = end
        return self.host[offset:end].view(dtype)

    def put(
        self, name: str, values: Sequence[int] | np.ndarray | torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        """Writes `values` (a list, numpy array or CPU tensor) as field `name`."""
        if isinstance(values, torch.Tensor):
            view = self.host_view(name, values.numel(), dtype)
            view.copy_(values.reshape(-1))
            return view
        array = np.asarray(values).reshape(-1)
        view = self.host_view(name, array.size, dtype)
        view.numpy()[:] = array
        return view

    def upload(self) -> dict[str, torch.Tensor]:
        """One copy of the used bytes to the device; returns `{name: device view}`
        (1-D; also kept as `views`, so fields put by different callers are found)."""
        used = self._cursor
        if self.on_cuda and used:
            self.device_buffer[:used].copy_(self.host[:used], non_blocking=True)
            self._copy_done = torch.cuda.Event()
            self._copy_done.record(torch.cuda.current_stream(self.device))
        self.views = {
            name: self.device_buffer[offset : offset + numel * dtype.itemsize].view(dtype)
            for name, offset, numel, dtype in self._fields
        }
        return self.views

    def _grow(self, needed: int) -> None:
        if self._copy_done is not None:  # the old host buffer may still be a copy source
            self._copy_done.synchronize()
            self._copy_done = None
        old_host, used = self.host, self._cursor
        capacity = 1 << (needed - 1).bit_length()
        log.debug("step staging grows from %d to %d bytes", old_host.numel(), capacity)
        self._allocate(capacity)
        self.host[:used].copy_(old_host[:used])  # fields already written this step
