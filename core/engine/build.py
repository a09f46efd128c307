"""`build_engine`: the one place a config becomes an engine.

A config is a mapping (a plain dict or a Hydra DictConfig) with the component
nodes `model`, `scheduler`, `allocator`, `preemption`, `attention` (each a name
or `{name: ..., **options}`) and an `engine` node of engine options.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

import torch

from servelab.contracts.kinds import KINDS
from servelab.engine.engine import Engine
from servelab.errors import ConfigError
from servelab.executor.device_memory import (
    allocated_before_weights,
    check_utilization,
    device_memory_budget,
    estimate_activation_bytes,
)
from servelab.executor.forward import CPU_KERNEL_CHOICES, choose_forward
from servelab.executor.host_memory import keep_freed_memory
from servelab.executor.kv_cache import KVCache
from servelab.model.loader import load_model, resolve_dtype
from servelab.model.sampler import Sampler
from servelab.registry.construct import construct
from servelab.registry.plugin_manager import get_plugin_manager, notify
from servelab.registry.typed import check_value

log = logging.getLogger(__name__)

ENGINE_DEFAULTS: dict[str, Any] = {
    "max_num_seqs": 64,
    "max_num_batched_tokens": None,  # None: max(2048, max_model_len)
    "max_model_len": 1024,
    "kv_cache_memory": "64MiB",
    "swap_space": "64MiB",
    "dtype": "float32",
    "device": "cpu",
    "seed": 0,
    "num_threads": None,  # None: leave torch's default
    "compile": False,  # torch.compile the model's forward (dynamic shapes, attention eager)
    # servelab's C++ CPU kernels for the model's matmuls: auto (where they can run) | on | off
    "cpu_kernels": "auto",
    # replay decode steps through CUDA graphs (CUDA and a graph-safe backend; else eager + warning)
    "cuda_graphs": False,
    # None: the KV cache takes kv_cache_memory; a fraction in (0, 1]: it takes what this
    # share of the CUDA device leaves after the weights and an activation estimate
    "gpu_memory_utilization": None,
}

# what each engine option must be (sizes take bytes or "64MiB"-style strings)
ENGINE_TYPES: dict[str, Any] = {
    "max_num_seqs": int,
    "max_num_batched_tokens": int | None,
    "max_model_len": int,
    "kv_cache_memory": int | str,
    "swap_space": int | str,
    "dtype": str,
    "device": str,
    "seed": int,
    "num_threads": int | None,
    "compile": bool,
    "cpu_kernels": str,
    "cuda_graphs": bool,
    "gpu_memory_utilization": float | None,
}
POSITIVE = ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "num_threads")

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


def _to_dict(node: Any) -> Any:
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(node, DictConfig):
            return OmegaConf.to_container(node, resolve=True)
    except ImportError:  # pragma: no cover
        pass
    return node


def resolve_device(name: str | torch.device) -> torch.device:
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "device 'cuda' was asked for but no CUDA device is available; use device=cpu"
        )
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"unknown device {name!r}; accepted: cpu, cuda")
    return device


def model_source(node: Any) -> str:
    """A model node is a name or path string, or `{name: ..., path: ...}` (path wins)."""
    if isinstance(node, str):
        return node
    if isinstance(node, Mapping):
        unknown = set(node) - {"name", "path"}
        if unknown:
            raise ConfigError(f"unknown model option(s) {sorted(unknown)}; accepted: name, path")
        source = node.get("path") or node.get("name")
        if source:
            return str(source)
    raise ConfigError(
        f"model must be a named shape, a checkpoint folder or {{name, path}}; got {node!r}"
    )


def engine_options(node: Mapping | None) -> dict[str, Any]:
    """The engine node over `ENGINE_DEFAULTS`; an unknown option, or a value the
    device options cannot take, is a ConfigError."""
    options = dict(ENGINE_DEFAULTS)
    for key, value in (node or {}).items():
        if key not in ENGINE_DEFAULTS:
            raise ConfigError(
                f"unknown engine option {key!r}; accepted: {', '.join(sorted(ENGINE_DEFAULTS))}"
            )
        options[key] = value
    for key, annotation in ENGINE_TYPES.items():
        check_value(f"engine option {key}", options[key], annotation)
    for key in POSITIVE:
        if options[key] is not None and options[key] < 1:
            raise ConfigError(f"engine option {key} must be >= 1, got {options[key]!r}")
    if options["gpu_memory_utilization"] is not None:
        check_utilization(options["gpu_memory_utilization"])
    if options["cpu_kernels"] not in CPU_KERNEL_CHOICES:
        raise ConfigError(
            f"engine option cpu_kernels must be one of {', '.join(CPU_KERNEL_CHOICES)}, "
            f"got {options['cpu_kernels']!r}"
        )
    return options


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


def attention_backend(spec: Any, model_config) -> Any:
    """The attention backend `spec` names (a name or `{name: ..., **options}`),
    shaped for `model_config`'s heads."""
    return construct(
        "attention",
        spec,
        num_heads=model_config.num_heads,
        num_kv_heads=model_config.num_kv_heads,
        head_dim=model_config.head_dim,
        scale=model_config.attention_scale,
    )


def build_engine(config: Mapping) -> Engine:
    config = _to_dict(config)
    unknown = set(config) - {"model", "engine", *KINDS}
    if unknown:
        raise ConfigError(
            f"unknown config key(s) {sorted(unknown)}; accepted: model, engine, {', '.join(KINDS)}"
        )
    get_plugin_manager()
    opts = engine_options(config.get("engine"))
    device = resolve_device(opts["device"])
    dtype = resolve_dtype(opts["dtype"])
    if opts["num_threads"]:
        torch.set_num_threads(int(opts["num_threads"]))
    if device.type == "cpu":
        keep_freed_memory()  # activations reused from the heap, not faulted in each step

    source = model_source(config.get("model", "tiny"))
    # read before the weights load: a CPU device fails here, not after a long load, and
    # what torch already held on the device is not counted as weights
    sizes_from_device = opts["gpu_memory_utilization"] is not None
    allocated_before = allocated_before_weights(device) if sizes_from_device else 0
    model, model_config, tokenizer = load_model(source, dtype, device, seed=opts["seed"])
    model_forward = choose_forward(model, opts["cpu_kernels"], bool(opts["compile"]))
    max_model_len = int(opts["max_model_len"])
    if max_model_len > model_config.max_position_embeddings:
        raise ConfigError(
            f"max_model_len={max_model_len} exceeds the model's max_position_embeddings="
            f"{model_config.max_position_embeddings}"
        )
    bytes_per_token = KVCache.bytes_per_token(
        model_config.num_layers, model_config.num_kv_heads, model_config.head_dim, dtype
    )
    batched = opts["max_num_batched_tokens"] or max(2048, max_model_len)
    kv_bytes = kv_cache_bytes(opts, device, model_config, dtype, int(batched), allocated_before)
    token_capacity = kv_bytes // bytes_per_token
    host_capacity = parse_bytes(opts["swap_space"], "swap_space") // bytes_per_token

    parts = {k: config.get(k) or KINDS[k].default for k in KINDS}
    allocator = construct(
        "allocator",
        parts["allocator"],
        token_capacity=token_capacity,
        host_token_capacity=host_capacity,
        max_model_len=max_model_len,
    )
    preemption = construct("preemption", parts["preemption"])
    scheduler = construct(
        "scheduler",
        parts["scheduler"],
        allocator=allocator,
        preemption=preemption,
        max_num_seqs=int(opts["max_num_seqs"]),
        max_num_batched_tokens=int(batched),
        max_model_len=max_model_len,
    )
    backend = attention_backend(parts["attention"], model_config)
    backend.check(allocator, device, dtype)
    kv_cache = KVCache(
        model_config.num_layers,
        allocator.num_blocks,
        allocator.block_size,
        model_config.num_kv_heads,
        model_config.head_dim,
        dtype,
        device,
        num_host_blocks=getattr(allocator, "num_host_blocks", 0),
    )
    engine = Engine(
        model,
        model_config,
        tokenizer,
        scheduler,
        allocator,
        backend,
        kv_cache,
        Sampler(),
        device,
        max_model_len,
        seed=int(opts["seed"]),
        notify=notify,
        model_forward=model_forward,
        config={"model": config.get("model", "tiny"), "engine": opts, **parts},
    )
    if opts["cuda_graphs"]:
        # captured before the first step (and before engine_ready): the capture runs
        # every bucket once, so Triton compiles outside any measured step
        engine.runner.enable_decode_graphs(
            max_num_seqs=int(opts["max_num_seqs"]), max_model_len=max_model_len
        )
    notify("servelab_engine_ready", engine=engine)
    return engine
