"""`executor=model`: the real forward. It loads the weights, allocates the KV
tensors and runs each step through the `ModelRunner` (inputs, forward, sampling):
`bind` makes the runner's `execute` this executor's own, so a step never enters this
module. Its clock is the wall clock. The default: every token is the model's own.

With `engine.tensor_parallel_size=N > 1` this process is rank 0 of N: it holds
rank 0's shard (`servelab.executor.parallel`), sends every step's copies and
inputs to the workers before its own forward, and samples alone.
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
from servelab.executor.parallel import group as tp_group
from servelab.executor.parallel.common import data_backend
from servelab.executor.parallel.protocol import (
    BIND,
    LOAD,
    BindMessage,
    LoadMessage,
    load_shard,
    shard_kv_cache,
)
from servelab.executor.parallel.runner import TensorParallelRunner
from servelab.executor.sizing import kv_cache_bytes
from servelab.model.loader import load_model, load_shape, model_source, resolve_dtype
from servelab.model.sampler import Sampler
from servelab.model.sharding import check_tensor_parallel
from servelab.step.plan import SampledTokens, StepPlan


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
    runs_tier_copies = True  # KVCache.apply runs them

    def __init__(self, model: Any, hardware: Any, engine_options: dict) -> None:
        opts = engine_options
        self.tp = int(opts.get("tensor_parallel_size", 1))
        # prompt logprobs need an LM head over prompt rows the workers do not compute
        self.scores_prompts = self.tp == 1
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
        self.group = None
        if self.tp > 1:
            self._load_tensor_parallel(source)
        else:
            self.model, self.model_config, self.tokenizer = load_model(
                source, self.dtype, self.device, seed=opts["seed"]
            )
            self.model_forward = choose_forward(
                self.model, opts["cpu_kernels"], bool(opts["compile"])
            )
        # unseeded rows' noise is drawn where the logits are: no [N, vocab] upload per step
        self.generator = torch.Generator(device=self.device).manual_seed(int(opts["seed"]))
        self.sampler = Sampler()
        self.kv_cache: KVCache | None = None
        self.runner: ModelRunner | None = None

    def _load_tensor_parallel(self, source: str) -> None:
        """Rank 0's shard; the workers load theirs at the same time."""
        opts = self.opts
        # the shape is checked before any worker starts: a bad size fails in milliseconds
        check_tensor_parallel(load_shape(source), self.tp)
        backend = data_backend(self.device.type, opts["distributed_backend"])
        if backend == "gloo" and self.device.type == "cuda" and opts["cuda_graphs"]:
            raise ConfigError(
                "engine.cuda_graphs=true under tensor parallelism captures the all-reduces "
                "in the graphs, which NCCL can and gloo cannot: set "
                "distributed_backend=nccl (or auto), or cuda_graphs=false"
            )
        self.group = tp_group.acquire(
            self.tp, self.device, float(opts["distributed_timeout"]), backend
        )
        self.lease = self.group.lease
        message = LoadMessage(
            source=source,
            dtype=str(opts["dtype"]),
            seed=int(opts["seed"]),
            cpu_kernels=str(opts["cpu_kernels"]),
            compile=bool(opts["compile"]),
            num_threads=opts["num_threads"],
        )
        self.group.send(LOAD, message)
        try:
            self.model, self.model_forward, self.model_config, self.tokenizer = load_shard(
                message, 0, self.tp, self.device, self.group.all_reduce
            )
        except Exception:
            # the workers are now out of step with rank 0: the next engine starts afresh
            self.group.stop(graceful=False)
            raise
        self.group.barrier()  # every worker loaded its shard (or the error names the one that failed)

    @property
    def attention_config(self):
        """One rank's heads: what every rank's attention backend is built for."""
        return self.model.config

    def kv_bytes_per_token(self) -> int:
        c = self.model.config  # one rank's KV heads; every rank holds as many
        per_rank = KVCache.bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, self.dtype)
        return per_rank * self.tp

    def kv_cache_bytes(self, max_num_batched_tokens: int) -> int:
        # with gpu_memory_utilization: rank 0's device, its shard, as every rank's share
        per_device = self.opts["gpu_memory_utilization"] is not None
        return kv_cache_bytes(
            self.opts,
            self.device,
            self.model.config if per_device else self.model_config,
            self.dtype,
            max_num_batched_tokens,
            self.allocated_before,
        ) * (self.tp if per_device else 1)

    def bind(self, allocator, backend) -> None:
        backend.check(allocator, self.device, self.dtype)
        bind = BindMessage(
            num_blocks=allocator.num_blocks,
            block_size=allocator.block_size,
            num_host_blocks=getattr(allocator, "num_host_blocks", 0),
            attention=getattr(backend, "config_node", {"name": backend.name}),
        )
        self.kv_cache = shard_kv_cache(self.model, bind, self.device)
        runner_args = (
            self.model_forward,
            backend,
            self.kv_cache,
            allocator,
            self.sampler,
            self.device,
            self.generator,
        )
        if self.group is None:
            self.runner = ModelRunner(*runner_args)
        else:
            self.group.send(BIND, bind)
            self.group.barrier()
            self.runner = TensorParallelRunner(
                *runner_args,
                group=self.group,
                lease=self.lease,
                vocab_size=self.model_config.vocab_size,
            )
        # a step goes straight to the runner: this part is no hop on the request path
        self.execute = self.runner.execute  # type: ignore[method-assign]
        if self.opts["cuda_graphs"]:
            # captured before the first step (and before engine_ready): the capture runs
            # every bucket once, so Triton compiles outside any measured step
            self.runner.enable_decode_graphs(
                max_num_seqs=int(self.opts["max_num_seqs"]),
                max_model_len=int(self.opts["max_model_len"]),
            )

    def apply(self, copies) -> None:
        cache = self.kv_cache
        cache.apply(copies)
        # plain attributes, read every step without a call into this module
        self.bytes_swapped_out = cache.bytes_swapped_out
        self.bytes_swapped_in = cache.bytes_swapped_in
        self.tier_load_seconds = cache.tier_load_seconds
        self.tier_store_seconds = cache.tier_store_seconds
        if self.group is not None and copies:
            self.runner.pending_copies.append(copies)  # the workers run them before the next step

    def wrap_device_work(self, wrap):
        if self.runner is None:
            raise RuntimeError("ModelExecutor.wrap_device_work before bind(): no model runner yet")
        self.runner.wrap_device_work(wrap)
        return True

    def execute(self, plan: StepPlan) -> SampledTokens:
        """Replaced at `bind` by the runner's own `execute` (see there)."""
        raise RuntimeError("ModelExecutor.execute before bind(): there is no model runner yet")

    @property
    def graphs_status(self) -> str:
        return self.runner.graphs_status if self.runner is not None else "off (not bound)"

    # -- a request's K/V (the handover); tp > 1 is refused before these are called
    def kv_layout(self, num_tokens: int):
        return self.kv_cache.token_layout(num_tokens)

    def read_kv(self, block_table: list[int], num_tokens: int) -> torch.Tensor:
        return self.kv_cache.read(block_table, num_tokens)

    def write_kv(self, block_table: list[int], kv, start: int, end: int) -> None:
        self.kv_cache.write(block_table, kv, start, end)

    def describe(self) -> dict:
        if self.group is None:
            return {}
        return {
            "tensor_parallel_size": self.tp,
            "distributed_backend": self.group.backend,
            "tensor_parallel_workers": self.group.pids,
        }


@hookimpl
def servelab_register_executors() -> dict[str, type]:
    return {"model": ModelExecutor}
