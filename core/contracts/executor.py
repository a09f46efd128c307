"""The executor contract: a step's tensor work (inputs, the model, sampling, block
copies) and the clock the engine reads time from.

The engine decides nothing here: it hands the executor each step's `StepPlan`
(already scheduled) and the allocator's `BlockCopies`, and records what comes
back. So the same scheduler, allocator and preemption objects run against the
real model (`model`) or a cost model (`simulated`), and every scheduling
decision is the same code either way.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from servelab.contracts.allocator import KVAllocator
    from servelab.contracts.attention import AttentionBackend
    from servelab.step.plan import BlockCopies, SampledTokens, StepPlan


class Executor(abc.ABC):
    """Runs steps; owns the model (or its stand-in), the KV tensors and the clock.

    Lifecycle: constructed from its options and the context, it knows the
    model's shape (`model_config`) and the KV budget (`kv_cache_bytes`); the
    engine then sizes the allocator, and `bind` hands it the allocator and the
    attention backend before the first step.

    Rules: `execute(plan)` returns one token per sampling sequence (n for a
    prompt that forks now), in the model runner's order (a decode batch's rows
    first); `apply(copies)` runs a step's copies in `BlockCopies`' order (a KV
    tier's stores, swap-out, a tier's loads, swap-in, copy-on-write) and adds the
    swaps' bytes to `bytes_swapped_out` / `bytes_swapped_in`; `now()` never goes backwards. An executor whose clock
    is virtual (`virtual_clock`) advances it by what a step would cost, and
    `sleep` advances it instead of waiting.

    Engine-supplied context: `model` (the model node), `hardware` (a profile
    node or None), `engine_options` (the checked engine options).

    The engine and the code above it (the handover, the CLI, the cluster) reach an
    executor only through what this class declares; the defaults are an executor's
    without tensors (a simulated one): no device, no K/V to read or write.
    """

    description: ClassVar[str] = ""
    virtual_clock: ClassVar[bool] = False  # True: now() is modelled time, sleep() never waits
    # True: `apply` runs a KV tier's copies (`BlockCopies.tier_*`); an engine refuses a
    # tier with an executor that does not declare it (its loads would leave blocks unwritten)
    runs_tier_copies: ClassVar[bool] = False

    model_config: Any  # servelab.model.config.ModelConfig
    tokenizer: Any = None  # None: prompts must be token ids
    bytes_swapped_out: int = 0
    bytes_swapped_in: int = 0
    tier_load_seconds: float = 0.0  # time spent running a KV tier's loads (modelled, simulated)
    tier_store_seconds: float = 0.0  # and its stores
    device: Any = None  # the torch.device its tensors live on; None: it keeps none
    tp: int = 1  # tensor-parallel ranks; over 1, each holds a share of every token's K/V
    scores_prompts: bool = True  # whether it computes prompt_logprobs (False: refused)
    # what became of engine.cuda_graphs: "captured: ...", "eager: <why>" or "off (<why>)"
    graphs_status: str = "off (no model forward)"

    @abc.abstractmethod
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V one token takes over every layer (all devices together)."""

    @abc.abstractmethod
    def kv_cache_bytes(self, max_num_batched_tokens: int) -> int:
        """The KV cache's memory budget (all devices together)."""

    @abc.abstractmethod
    def bind(self, allocator: KVAllocator, backend: AttentionBackend) -> None:
        """Called once, before the first step: the parts this executor serves."""

    @abc.abstractmethod
    def apply(self, copies: BlockCopies) -> None:
        """Runs one step's block copies in `BlockCopies`' order; the engine calls it
        only for a step that has some (and once more after a step whose update
        queued a write-through tier's stores)."""

    @abc.abstractmethod
    def execute(self, plan: StepPlan) -> SampledTokens:
        """Runs one non-empty step: the sampled tokens of its sampling sequences."""

    # now() -> seconds on this executor's clock (any origin; never decreasing). The
    # wall clock by default, called straight: the engine reads it several times a step.
    now = staticmethod(time.perf_counter)

    def sleep(self, seconds: float) -> None:
        """Waits (a real clock) or moves the clock on (a virtual one)."""
        time.sleep(seconds)

    @property
    def attention_config(self) -> Any:
        """The shape the attention backend is built for: the heads one device
        attends over (a tensor-parallel rank's share), `model_config` otherwise."""
        return self.model_config

    # -- a request's K/V, for prefill/decode disaggregation (servelab.engine.handover).
    # Layout: [2 (k, v), num_layers, num_tokens, num_kv_heads, head_dim], token i of a
    # sequence at block_table[i // block_size], offset i % block_size.
    def kv_layout(self, num_tokens: int) -> tuple[tuple[int, ...], Any] | None:
        """`(shape, dtype)` of `num_tokens` tokens' K/V as `read_kv` returns them and
        `write_kv` takes them; None: no K/V tensors (only blocks and time are modelled)."""
        return None

    def read_kv(self, block_table: list[int], num_tokens: int) -> Any:
        """A copy of a sequence's first `num_tokens` K/V (`kv_layout`); None without tensors."""
        return None

    def write_kv(self, block_table: list[int], kv: Any, start: int, end: int) -> None:
        """Writes tokens [start, end) of `kv` (`kv_layout(len)`) into the sequence's slots."""
        raise NotImplementedError(
            f"executor {type(self).__name__} keeps no K/V tensors (kv_layout is None): "
            "there is no K/V to write"
        )

    def describe(self) -> dict[str, Any]:
        """What a run's provenance records about this executor (e.g. its hardware profile)."""
        return {}

    def wrap_device_work(self, wrap: Callable[[Callable], Callable]) -> bool:
        """Replaces each call that does a step's device work (what a GPU would run as
        kernels) with `wrap(call)`, so that a caller can time the host's share of a step
        apart (`servelab-calibrate --host`). False: this executor cannot (the default)."""
        return False
