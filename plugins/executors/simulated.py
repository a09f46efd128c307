"""`executor=simulated`: the real scheduler, allocator and preemption objects
against a cost model (`servelab.executor.cost_model`) instead of a forward.

No weights and no KV tensors: the model is only its shape, the KV budget comes
from the hardware profile (device memory x `gpu_memory_utilization` - weights -
activation estimate, per device, as the CUDA path sizes it) or from
`kv_cache_memory`. Each step moves a virtual clock on by its modelled time, so
arrivals are served without sleeping. Sampled tokens are stand-ins: a hash of
(request, sample index, output position), never an EOS token, so forks differ,
prefix caching of generated text behaves as for real, and requests run to
`max_tokens`.
"""

from __future__ import annotations

import zlib
from typing import Any

from servelab.contracts.executor import Executor
from servelab.contracts.hookspecs import hookimpl
from servelab.errors import ConfigError
from servelab.executor.cost_model import CostModel, Shape, StepShape, step_shape
from servelab.executor.device_memory import (
    MemoryBudget,
    check_utilization,
    estimate_activation_bytes,
    model_weight_bytes,
)
from servelab.executor.hardware import load_profile
from servelab.executor.sizing import parse_bytes
from servelab.model.config import DTYPES
from servelab.model.loader import load_shape, model_source
from servelab.step.plan import SampledTokens

MASK64 = (1 << 64) - 1


def stand_in_token(request_key: int, sample_index: int, position: int, vocab: int) -> int:
    """A deterministic token: splitmix64 of (request, sample, position) mod vocab."""
    x = (request_key * 0x9E3779B97F4A7C15 + sample_index * 0xBF58476D1CE4E5B9 + position) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return (x ^ (x >> 31)) % vocab


class SimulatedExecutor(Executor):
    description = "a cost model of the hardware profile; stand-in tokens, a virtual clock"
    virtual_clock = True

    def __init__(self, model: Any, hardware: Any, engine_options: dict) -> None:
        self.opts = engine_options
        self.model_config = load_shape(model_source(model))
        self.profile = load_profile(hardware)
        self.tp = int(engine_options.get("tensor_parallel_size", 1))
        dtype = str(engine_options["dtype"]).removeprefix("torch.")
        if dtype not in DTYPES:
            raise ConfigError(f"unsupported dtype {dtype!r}; valid dtypes: {', '.join(DTYPES)}")
        self.dtype = dtype
        self.element_size = DTYPES[dtype].itemsize
        c = self.model_config
        if c.num_heads % self.tp or c.num_kv_heads % self.tp:
            raise ConfigError(
                f"tensor_parallel_size={self.tp} must divide the model's {c.num_heads} query "
                f"and {c.num_kv_heads} KV heads"
            )
        self.cost = CostModel(Shape.of(c), self.profile, dtype, self.element_size, self.tp)
        self.time = 0.0
        self.bytes_swapped_out = 0
        self.bytes_swapped_in = 0
        self.bytes_copied = 0
        self.block_bytes = 0
        self.padded = False
        self._keys: dict[str, int] = {}  # request id -> its hash key
        self.eos = frozenset(c.eos_token_ids or ())

    # -- sizing
    def kv_bytes_per_token(self) -> int:
        c = self.model_config
        return 2 * c.num_layers * c.num_kv_heads * c.head_dim * self.element_size

    def kv_cache_bytes(self, max_num_batched_tokens: int) -> int:
        """Per device: memory x utilisation - weights / p - activation estimate; x p devices."""
        utilization = self.opts["gpu_memory_utilization"]
        if utilization is None:
            return parse_bytes(self.opts["kv_cache_memory"], "kv_cache_memory")
        check_utilization(utilization)
        weights = model_weight_bytes(self.model_config, DTYPES[self.dtype]) // self.tp
        activations = estimate_activation_bytes(
            self.model_config,
            max_num_batched_tokens,
            int(self.opts["max_num_seqs"]),
            DTYPES[self.dtype],
        )
        budget = MemoryBudget(self.profile.memory, float(utilization), weights, activations)
        return budget.kv_bytes * self.tp

    def bind(self, allocator, backend) -> None:
        self.block_bytes = allocator.block_size * self.kv_bytes_per_token()
        # the padded backend computes padded shapes; the cost model counts them
        self.padded = getattr(backend, "name", "") == "padded"

    # -- the clock
    def now(self) -> float:
        return self.time

    def sleep(self, seconds: float) -> None:
        self.time += max(0.0, seconds)

    def describe(self) -> dict[str, Any]:
        return {"hardware": self.profile.to_dict(), "tensor_parallel_size": self.tp}

    # -- a step
    def apply(self, copies) -> None:
        if not copies:
            return
        out = len(copies.swap_out) * self.block_bytes
        back = len(copies.swap_in) * self.block_bytes
        copied = len(copies.copy) * self.block_bytes
        self.bytes_swapped_out += out
        self.bytes_swapped_in += back
        self.bytes_copied += copied
        self.time += self.cost.copy_time(out + back, copied)

    def execute(self, plan) -> SampledTokens:
        step, owners, tokens = self.read_plan(plan)
        self.time += self.cost.step_time(step)
        return SampledTokens(owners, tokens)

    def read_plan(self, plan) -> tuple[StepShape, list[int], list[int]]:
        """The step's shape for the cost model, and its sampled tokens in the model
        runner's order (decode-batch rows, then items; n for a prompt that forks now)."""
        owners: list[int] = []
        tokens: list[int] = []
        vocab = self.model_config.vocab_size
        if plan.decodes is not None:
            positions = (plan.decode_starts + 1 - plan.decodes.prompt_lens).tolist()
            for seq, position in zip(plan.decode_seqs, positions):
                owners.append(seq.seq_id)
                tokens.append(self.token(seq.request_id, seq.sample_index, position, vocab))
        for item in plan.items:
            if not item.samples:
                continue
            seq = item.seq
            num_outputs = len(seq.token_ids) - seq.num_prompt_tokens
            p = seq.params
            forks = p.n if num_outputs == 0 and p.n > 1 and seq.group.needs_fork else 1
            for k in range(forks):
                index = k if forks > 1 else seq.sample_index
                owners.append(seq.seq_id)
                tokens.append(self.token(seq.request_id, index, num_outputs, vocab))
        return step_shape(plan, self.padded), owners, tokens

    def token(self, request_id: str, sample_index: int, position: int, vocab: int) -> int:
        key = self._keys.get(request_id)
        if key is None:
            key = self._keys[request_id] = zlib.crc32(request_id.encode())
        token = stand_in_token(key, sample_index, position, vocab)
        while token in self.eos:  # requests end at max_tokens, never at a stand-in EOS
            token = (token + 1) % vocab
        return token


@hookimpl
def servelab_register_executors() -> dict[str, type]:
    return {"simulated": SimulatedExecutor}
