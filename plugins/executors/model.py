"""`executor=model`: the real forward. It loads the weights, allocates the KV
tensors and runs each step through the `ModelRunner` (inputs, forward, sampling);
its clock is the wall clock. The default: every token is the model's own.
"""

from __future__ import annotations

from typing import Any

import torch

from servelab.contracts.executor import Executor
from servelab.contracts.hookspecs import hookimpl
from servelab.errors import ConfigError
from servelab.executor.device_memory import allocated_before_weights
from servelab.executor.forward import choose_forward
from servelab.executor.host_memory import keep_freed_memory
from servelab.executor.kv_cache import KVCache
from servelab.executor.model_runner import ModelRunner
from servelab.executor.sizing import kv_cache_bytes
from servelab.model.loader import load_model, model_source, resolve_dtype
from servelab.model.sampler import Sampler


def resolve_device(name: str | torch.device) -> torch.device:
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "device 'cuda' was asked for but no CUDA device is available; use device=cpu"
        )
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"unknown device {name!r}; accepted: cpu, cuda")
    return device


class ModelExecutor(Executor):
    description = "the real model forward on the configured device; wall-clock time"

    def __init__(self, model: Any, hardware: Any, engine_options: dict) -> None:
        opts = engine_options
        if int(opts.get("tensor_parallel_size", 1)) != 1:
            raise ConfigError(
                "executor=model runs on one device: engine.tensor_parallel_size must be 1, "
                f"got {opts['tensor_parallel_size']}; executor=simulated models tensor parallelism"
            )
        self.opts = opts
        self.device = resolve_device(opts["device"])
        self.dtype = resolve_dtype(opts["dtype"])
        if opts["num_threads"]:
            torch.set_num_threads(int(opts["num_threads"]))
        if self.device.type == "cpu":
            keep_freed_memory()  # activations reused from the heap, not faulted in each step
        source = model_source(model)
        # read before the weights load: a CPU device fails here, not after a long load, and
        # what torch already held on the device is not counted as weights
        sizes_from_device = opts["gpu_memory_utilization"] is not None
        self.allocated_before = allocated_before_weights(self.device) if sizes_from_device else 0
        self.model, self.model_config, self.tokenizer = load_model(
            source, self.dtype, self.device, seed=opts["seed"]
        )
        self.model_forward = choose_forward(self.model, opts["cpu_kernels"], bool(opts["compile"]))
        # unseeded rows' noise is drawn where the logits are: no [N, vocab] upload per step
        self.generator = torch.Generator(device=self.device).manual_seed(int(opts["seed"]))
        self.sampler = Sampler()
        self.kv_cache: KVCache | None = None
        self.runner: ModelRunner | None = None

    def kv_bytes_per_token(self) -> int:
        c = self.model_config
        return KVCache.bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, self.dtype)

    def kv_cache_bytes(self, max_num_batched_tokens: int) -> int:
        return kv_cache_bytes(
            self.opts,
            self.device,
            self.model_config,
            self.dtype,
            max_num_batched_tokens,
            self.allocated_before,
        )

    def bind(self, allocator, backend) -> None:
        backend.check(allocator, self.device, self.dtype)
        c = self.model_config
        self.kv_cache = KVCache(
            c.num_layers,
            allocator.num_blocks,
            allocator.block_size,
            c.num_kv_heads,
            c.head_dim,
            self.dtype,
            self.device,
            num_host_blocks=getattr(allocator, "num_host_blocks", 0),
        )
        self.runner = ModelRunner(
            self.model_forward,
            backend,
            self.kv_cache,
            allocator,
            self.sampler,
            self.device,
            self.generator,
        )
        if self.opts["cuda_graphs"]:
            # captured before the first step (and before engine_ready): the capture runs
            # every bucket once, so Triton compiles outside any measured step
            self.runner.enable_decode_graphs(
                max_num_seqs=int(self.opts["max_num_seqs"]),
                max_model_len=int(self.opts["max_model_len"]),
            )

    @property
    def bytes_swapped_out(self) -> int:
        return self.kv_cache.bytes_swapped_out

    @property
    def bytes_swapped_in(self) -> int:
        return self.kv_cache.bytes_swapped_in

    def apply(self, copies) -> None:
        self.kv_cache.apply(copies)

    def execute(self, plan):
        return self.runner.execute(plan)


@hookimpl
def servelab_register_executors() -> dict[str, type]:
    return {"model": ModelExecutor}
