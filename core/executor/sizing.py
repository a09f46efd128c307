"""Sizes in config values (`parse_bytes`) and the KV cache's memory budget
(`kv_cache_bytes`): `kv_cache_memory`, or a share of the CUDA device less the
weights and an activation estimate. Shared by the engine builder and the
executors, which size the KV cache before the allocator exists.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

import torch

from servelab.errors import ConfigError
from servelab.executor.device_memory import device_memory_budget, estimate_activation_bytes

log = logging.getLogger(__name__)

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}


def parse_bytes(value: int | float | str, what: str = "size") -> int:
    """`4GiB`, `64MiB`, `512MB`, `1048576` -> bytes."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value < 0:
            raise ConfigError(f"{what} must be >= 0 bytes, got {value}")
        return int(value)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if not match or match.group(2).lower() not in _UNITS:
        raise ConfigError(
            f"{what}: cannot read {value!r} as a size; use bytes or a number with one of "
            "B, KB, MB, GB, KiB, MiB, GiB, TiB"
        )
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def kv_cache_bytes(
    opts: Mapping[str, Any],
    device: torch.device,
    model_config,
    dtype: torch.dtype,
    max_num_batched_tokens: int,
    allocated_before: int,
) -> int:
    """The KV cache's memory. `kv_cache_memory`, unless `gpu_memory_utilization`
    is set: then that share of the device, read after the weights loaded, less
    the weights (what torch allocated since `allocated_before`) and an estimate
    of the activation peak (the largest step; with CUDA graphs also the largest
    decode bucket, whose memory the graphs' pool keeps)."""
    utilization = opts["gpu_memory_utilization"]
    if utilization is None:
        return parse_bytes(opts["kv_cache_memory"], "kv_cache_memory")
    max_num_seqs = int(opts["max_num_seqs"])
    activations = estimate_activation_bytes(
        model_config, max_num_batched_tokens, max_num_seqs, dtype
    )
    if opts["cuda_graphs"]:
        activations += estimate_activation_bytes(model_config, max_num_seqs, max_num_seqs, dtype)
    budget = device_memory_budget(device, utilization, activations, allocated_before)
    kv_bytes = budget.kv_bytes
    log.info(
        "KV cache: %.2f GiB (gpu_memory_utilization=%s of %.2f GiB, weights %.2f GiB, "
        "activation estimate %.2f GiB); kv_cache_memory is ignored",
        kv_bytes / 1024**3,
        utilization,
        budget.total_bytes / 1024**3,
        budget.weights_bytes / 1024**3,
        activations / 1024**3,
    )
    return kv_bytes
