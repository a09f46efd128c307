"""`build_engine`: the one place a config becomes an engine.

A config is a mapping (a plain dict or a Hydra DictConfig) with the component
nodes `model`, `scheduler`, `allocator`, `preemption`, `attention`, `executor`,
`proposer`, `kv_tier` (each a name or `{name: ..., **options}`), an `engine` node
of engine options, and optionally `hardware` (a profile the simulated executor reads).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from servelab.contracts.kinds import ENGINE_KINDS, KINDS
from servelab.engine.engine import Engine, Events
from servelab.engine.tiers import build_kv_tier
from servelab.errors import ConfigError
from servelab.executor.device_memory import check_utilization
from servelab.executor.forward import CPU_KERNEL_CHOICES
from servelab.executor.parallel.common import check_backend_name
from servelab.executor.sizing import kv_cache_bytes, parse_bytes  # noqa: F401 (re-exported)
from servelab.registry.construct import attention_backend, construct  # noqa: F401 (re-exported)
from servelab.registry.plugin_manager import get_plugin_manager
from servelab.registry.typed import check_value
from servelab.scheduling.core import SchedulerCore
from servelab.scheduling.speculation import Speculation

log = logging.getLogger(__name__)

DEFAULT_MAX_MODEL_LEN = 1024

ENGINE_DEFAULTS: dict[str, Any] = {
    "max_num_seqs": 64,
    "max_num_batched_tokens": None,  # None: max(2048, max_model_len)
    # None: the model's max_position_embeddings (a checkpoint's config.json), at most
    # DEFAULT_MAX_MODEL_LEN, so a small CPU model does not size its batches for 40k tokens
    "max_model_len": None,
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
    # processes (devices) one model is split over: tensor parallelism (docs/parallel.md)
    "tensor_parallel_size": 1,
    # seconds any tensor-parallel collective may wait before the engine reports its workers
    "distributed_timeout": 300.0,
    # tensor parallelism's collectives: auto (NCCL between CUDA devices, gloo on CPUs),
    # nccl, or gloo (on CUDA too: ranks may then share a device, to check the code path)
    "distributed_backend": "auto",
}

# what each engine option must be (sizes take bytes or "64MiB"-style strings)
ENGINE_TYPES: dict[str, Any] = {
    "max_num_seqs": int,
    "max_num_batched_tokens": int | None,
    "max_model_len": int | None,
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
    "tensor_parallel_size": int,
    "distributed_timeout": float,
    "distributed_backend": str,
}
POSITIVE = (
    "max_num_seqs",
    "max_num_batched_tokens",
    "max_model_len",
    "num_threads",
    "tensor_parallel_size",
    "distributed_timeout",
)


def _to_dict(node: Any) -> Any:
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(node, DictConfig):
            return OmegaConf.to_container(node, resolve=True)
    except ImportError:  # pragma: no cover
        pass
    return node


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
    check_backend_name(options["distributed_backend"], "engine option distributed_backend")
    return options


def build_engine(config: Mapping) -> Engine:
    config = _to_dict(config)
    # the router and cluster nodes are above the engine (servelab.cluster): ignored here
    accepted = {"model", "engine", "hardware", "cluster", *KINDS}
    unknown = set(config) - accepted
    if unknown:
        raise ConfigError(
            f"unknown config key(s) {sorted(unknown)}; accepted: {', '.join(sorted(accepted))}"
        )
    get_plugin_manager()
    opts = engine_options(config.get("engine"))
    parts = {k: config.get(k) or KINDS[k].default for k in ENGINE_KINDS}
    # the executor first: it loads the model (or reads its shape) and sizes the KV cache
    executor = construct(
        "executor",
        parts["executor"],
        model=config.get("model", "tiny"),
        hardware=config.get("hardware"),
        engine_options=opts,
    )
    model_config = executor.model_config
    if opts["max_model_len"] is None:  # taken from the model, as vLLM takes it
        opts["max_model_len"] = min(DEFAULT_MAX_MODEL_LEN, model_config.max_position_embeddings)
    max_model_len = int(opts["max_model_len"])
    if max_model_len > model_config.max_position_embeddings:
        raise ConfigError(
            f"max_model_len={max_model_len} exceeds the model's max_position_embeddings="
            f"{model_config.max_position_embeddings}"
        )
    bytes_per_token = executor.kv_bytes_per_token()
    batched = opts["max_num_batched_tokens"] or max(2048, max_model_len)
    token_capacity = executor.kv_cache_bytes(int(batched)) // bytes_per_token
    host_capacity = parse_bytes(opts["swap_space"], "swap_space") // bytes_per_token

    allocator = construct(
        "allocator",
        parts["allocator"],
        token_capacity=token_capacity,
        host_token_capacity=host_capacity,
        max_model_len=max_model_len,
    )
    kv_tier = build_kv_tier(
        parts["kv_tier"], config.get("model", "tiny"), executor, allocator, opts
    )
    preemption = construct("preemption", parts["preemption"])
    proposer = construct(
        "proposer",
        parts["proposer"],
        vocab_size=model_config.vocab_size,
        engine_options=opts,
    )
    scheduler = SchedulerCore(
        construct("scheduler", parts["scheduler"]),
        allocator=allocator,
        preemption=preemption,
        max_num_seqs=int(opts["max_num_seqs"]),
        max_num_batched_tokens=int(batched),
        max_model_len=max_model_len,
        speculation=Speculation(proposer, max_model_len),
    )
    if executor.virtual_clock and hasattr(scheduler.policy, "clock"):
        # a policy that reads time (static's batch timeout) reads the executor's
        scheduler.policy.clock = executor.now
    backend = attention_backend(parts["attention"], executor.attention_config)
    executor.bind(allocator, backend)
    described = {"model": config.get("model", "tiny"), "engine": opts, **parts}
    if config.get("hardware") is not None:
        described["hardware"] = config["hardware"]
    engine = Engine(
        executor,
        scheduler,
        allocator,
        backend,
        max_model_len,
        events=Events(get_plugin_manager()),
        config=described,
        kv_tier=kv_tier,
    )
    engine.events.notify("servelab_engine_ready", engine=engine)
    return engine
