"""How much device memory the KV cache may take (`gpu_memory_utilization`).

Rules:
- KV budget = total device memory x utilization - weights - activation peak.
  A budget <= 0 is a `ConfigError` naming every number; when other processes
  hold memory, the budget shrinks to what is actually free (with a warning);
- everything here that only does arithmetic runs on any machine, so the CPU
  tests cover it; reading the device (`read_device_memory`, the one function
  that does, and `profile_peak_bytes`) needs CUDA, and on any other device it
  is a ConfigError that names the alternative, `kv_cache_memory`;
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

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
