"""`executor=simulated`: the real scheduler, allocator and preemption objects
against a cost model (`servelab.executor.cost_model`) instead of a forward.

No weights and no KV tensors: the model is only its shape, the KV budget comes
from the hardware profile (device memory x `gpu_memory_utilization` - weights -
activation estimate, per device, as the CUDA path sizes it) or from
`kv_cache_memory`. Each step moves a virtual clock on by its modelled time, so
arrivals are served without sleeping. Sampled tokens are stand-ins (`servelab.executor.stand_in`): a hash
of (request, sample index, output position), never an EOS token, so forks differ,
prefix caching of generated text behaves as for real, and requests run to
`max_tokens`. Logprobs, when a request asks, are those of a uniform draw: every
token's is -log(vocab), the alternatives the sampled token and the ids after it.

A KV tier's copies are priced per step by link (`tier_copy_time`): host memory
over the host link, a disk over it and an NVMe drive (`servelab.cluster.links`).

The engine's own CPU time per step is the hardware profile's `step_overhead` and
`seq_overhead`, or, with `host=NAME` (a host profile of `conf/host/`, a path or a
mapping), the figures `servelab-calibrate --host` measured from the real engine's
steps (`servelab.executor.host_profile`). By default a step is its host work then its
device work. `overlap=true` prices a step as the longer of the two while the engine
steps back to back, as an overlap scheduler does (SGLang's, vLLM's async scheduling:
the host prepares step n + 1 and reads back step n while the device runs); the first
step after the engine waited for arrivals pays both. It changes when tokens come,
never which: a stand-in request's length is known, so no step is scheduled past it.

Speculative decoding: a row with drafts is verified against the stand-ins (kept up
to the first that differs) and priced as a decode of its 1 + drafts query tokens
(`cost_model.step_shape`). When the engine's proposer names a `draft_model`
(`Proposer.draft_model`, read at engine start by this module's
`servelab_engine_ready`), each step also pays that model's forwards on the same
hardware and tensor-parallel degree: one decode step of its shape per draft
position over the rows drafting there, and its forward over the step's prompt
chunks (it keeps a KV cache of its own), each without the host's per-step work,
which the step pays once. Its weights and KV are not taken from the KV budget.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any, NamedTuple

import numpy as np

from servelab.cluster.links import LINKS, STORAGE_LINKS, Link
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
from servelab.executor.host_profile import load_host
from servelab.executor.sizing import parse_bytes
from servelab.executor.stand_in import avoid_eos, sequence_key, stand_in_token, stand_in_tokens
from servelab.model.config import DTYPES
from servelab.model.loader import load_shape, model_source
from servelab.step.plan import SampledTokens, StepPlan
from servelab.step.verify import kept_tokens

NVME = STORAGE_LINKS["nvme"]
SCALAR_ROWS = 16  # decode rows up to which stand-in tokens are drawn with Python ints
_EMPTY = np.zeros(0)
_EMPTY.flags.writeable = False


class DecodeRows(NamedTuple):
    """A plan's decode rows as the stand-in tokens read them: each row's key, and what
    turns its position into its output position (1 - its prompt length); as arrays
    too when there are more than SCALAR_ROWS (drawn with numpy), else None."""

    keys: list[int]
    offsets: list[int]
    key_array: np.ndarray | None
    offset_array: np.ndarray | None


class SimulatedExecutor(Executor):
    description = "a cost model of the hardware profile; stand-in tokens, a virtual clock"
    virtual_clock = True
    runs_tier_copies = True  # priced; there is no K/V to move
    samples_stand_ins = True  # its sampled tokens are servelab.executor.stand_in's
    graphs_status = "off (simulated)"

    def __init__(self, model: Any, hardware: Any, engine_options: dict,
                 host: str | dict | None = None, overlap: bool = False) -> None:  # fmt: skip
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
        self.host = load_host(host)
        self.overlap = overlap
        self.pipelined = False  # overlap: the last step ran just before this one
        self.cost = CostModel(Shape.of(c), self.profile, dtype, self.element_size, self.tp,
                              self.host)  # fmt: skip
        # a KV tier's host memory: the profile's host link, at PCIe's latency
        pcie = LINKS["pcie"]
        self.tier_host_link = Link("host", self.profile.host_link_bandwidth, pcie.latency_s)
        # the proposer's draft model, priced on the same hardware (price_drafts)
        self.draft_cost: CostModel | None = None
        self.draft_model: str | None = None
        self.draft_seconds = 0.0  # the part of the clock its forwards took
        self.time = 0.0
        self.bytes_swapped_out = 0
        self.bytes_swapped_in = 0
        self.bytes_copied = 0
        self.block_bytes = 0
        self.padded = False
        self._keys: dict[int, int] = {}  # seq_id -> its sample's hash key
        self._rows: tuple[list[int], DecodeRows] | None = None  # see _decode_rows
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
        if seconds > 0:
            self.time += seconds
            self.pipelined = False  # the host waited for work: nothing to overlap

    def describe(self) -> dict[str, Any]:
        described = {"hardware": self.profile.to_dict(), "tensor_parallel_size": self.tp}
        if self.host is not None:
            described["host"] = self.host.to_dict()
        if self.overlap:
            described["overlap"] = True
        if self.draft_model is not None:
            described["draft_model"] = self.draft_model
        return described

    # -- speculative decoding's draft model
    def price_drafts(self, proposer: Any) -> None:
        """Prices the forwards of `proposer`'s draft model from now on (none: a
        proposer without one, or None)."""
        node = proposer.draft_model() if proposer is not None else None
        if node is None:
            self.draft_cost = self.draft_model = None
            return
        self.draft_model = model_source(node)
        shape = Shape.of(load_shape(self.draft_model))
        self.draft_cost = CostModel(shape, self.profile, self.dtype, self.element_size, self.tp)

    def draft_time(self, plan: StepPlan, step: StepShape) -> float:
        """Seconds the draft model's forwards take in this step: its prefill of the
        step's prompt chunks, then one decode step per draft position over the rows
        with a draft there (the j-th reads the row's context and j drafts)."""
        draft = self.draft_cost
        if draft is None:
            return 0.0
        seconds = 0.0
        if len(step.prefill_q):
            prompts = StepShape(step.prefill_q, step.prefill_start, _EMPTY, 0)
            seconds += draft.device_time(prompts)
        counts = plan.draft_counts
        if counts is not None and counts.any():
            drafting = counts > 0
            drafted, keys = counts[drafting], plan.starts[drafting] + 1.0
            for j in range(int(drafted.max())):
                rows = drafted > j
                seconds += draft.device_time(StepShape(_EMPTY, _EMPTY, keys[rows] + j,
                                                       int(rows.sum())))  # fmt: skip
        self.draft_seconds += seconds
        return seconds

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
        if copies.has_tier_copies:
            stores = self.tier_copy_time(len(copies.tier_out), len(copies.tier_save))
            loads = self.tier_copy_time(len(copies.tier_in), len(copies.tier_fetch))
            self.time += stores + loads
            self.tier_load_seconds += loads
            self.tier_store_seconds += stores

    def tier_copy_time(self, host_blocks: int, storage_blocks: int) -> float:
        """A KV tier's copies one way (`servelab.cluster.links`): blocks to or from
        host memory cross the host link; to or from the tier's own storage (a disk)
        they cross it and an NVMe drive too. Each device moves its 1/p share."""
        host = self.tier_host_link
        seconds = 0.0
        for blocks, links in ((host_blocks, (host,)), (storage_blocks, (host, NVME))):
            if blocks:
                share = blocks * self.block_bytes / self.tp
                seconds += sum(link.transfer_seconds(share) for link in links)
        return seconds

    def execute(self, plan: StepPlan) -> SampledTokens:
        step, owners, tokens = self.read_plan(plan)
        cost = self.cost
        finishing = self.finishing(plan, owners) if cost.host.counts_finishing else 0
        seconds = cost.step_time(step, finishing)
        if self.draft_cost is not None:
            seconds += self.draft_time(plan, step)
        if self.overlap:
            host = cost.host_time(step, finishing)
            device = seconds - host
            seconds = max(host, device) if self.pipelined else host + device
            self.pipelined = True
        self.time += seconds
        sampled = SampledTokens(owners, tokens)
        if plan.draft_counts is not None:
            drafted = plan.draft_counts.tolist()
            sampled.runs = frozenset(s.seq_id for s, d in zip(plan.seqs, drafted) if d)
        if plan.logprobs_k >= 0:
            sampled.logprobs = self.stand_in_logprobs(tokens, plan.logprobs_k)
        for seq, start, count, _ in plan.rows(plan.num_decodes):  # prompt logprobs: stand-ins
            scored = seq.prompt_logprobs
            if scored is not None and len(scored) < seq.num_prompt_tokens:
                last = min(start + count, seq.num_prompt_tokens - 1)
                scored += [None] * (min(start + 1, seq.num_prompt_tokens) - len(scored))
                targets = seq.token_ids[len(scored) : last + 1]
                scored += self.stand_in_logprobs(targets, seq.params.prompt_logprobs)
        return sampled

    @staticmethod
    def finishing(plan: StepPlan, owners: list[int]) -> int:
        """Sequences this step ends: stand-ins never stop one early, so a sequence
        ends when the tokens sampled for it (`owners`: one entry each) reach its
        max_tokens."""
        got = Counter(owners)
        return sum(
            1
            for seq in plan.seqs
            if (n := got.get(seq.seq_id))
            and len(seq.token_ids) - seq.num_prompt_tokens + n >= seq.params.max_tokens
        )

    def stand_in_logprobs(self, tokens: list[int], k: int) -> list[dict]:
        """The rows `token_logprobs` returns, for tokens drawn uniformly over the vocab."""
        vocab = self.model_config.vocab_size
        logprob = -math.log(vocab)
        return [
            {
                "token_id": t,
                "logprob": logprob,
                "top": [((t + j) % vocab, logprob) for j in range(min(k, vocab))],
            }
            for t in tokens
        ]

    def read_plan(self, plan) -> tuple[StepShape, list[int], list[int]]:
        """The step's shape for the cost model, and its sampled tokens in the model
        runner's order (the decode rows, then the other sampling rows; n for a
        prompt that forks now)."""
        vocab = self.model_config.vocab_size
        n = plan.num_decodes
        owners: list[int] = plan.seq_ids[:n]
        tokens: list[int] = []
        if n:
            rows = self._decode_rows(plan)
            if n <= SCALAR_ROWS:  # a few rows: Python ints beat numpy's per-call cost
                starts = plan.starts[:n].tolist()
                drawn = [
                    stand_in_token(k, s + o, vocab)
                    for k, s, o in zip(rows.keys, starts, rows.offsets)
                ]
            else:
                assert rows.key_array is not None and rows.offset_array is not None
                positions = plan.starts[:n] + rows.offset_array
                drawn = stand_in_tokens(rows.key_array, positions, vocab).tolist()
            tokens = self.avoid_eos(drawn, vocab)
        drafts = plan.draft_counts.tolist() if plan.draft_counts is not None else None
        for row, (seq, _, _, samples) in enumerate(plan.rows(n), n):
            if not samples:
                continue
            num_outputs = len(seq.token_ids) - seq.num_prompt_tokens
            if drafts is not None and drafts[row]:  # a decode with drafts: verified
                key = self.key_of(seq.seq_id, seq.request_id, seq.sample_index)
                targets = [
                    stand_in_token(key, num_outputs + j, vocab) for j in range(drafts[row] + 1)
                ]
                kept = kept_tokens(self.avoid_eos(targets, vocab), seq.draft_tokens)
                owners += [seq.seq_id] * len(kept)
                tokens += kept
                continue
            p = seq.params
            forks = p.n if num_outputs == 0 and p.n > 1 and seq.group.needs_fork else 1
            for k in range(forks):
                index = k if forks > 1 else seq.sample_index
                key = sequence_key(seq.request_id, index) if forks > 1 else None
                if key is None:
                    key = self.key_of(seq.seq_id, seq.request_id, index)
                owners.append(seq.seq_id)
                tokens += self.avoid_eos([stand_in_token(key, num_outputs, vocab)], vocab)
        return step_shape(plan, self.padded), owners, tokens

    def _decode_rows(self, plan) -> DecodeRows:
        """The decode rows' keys and offsets. Kept while the rows are the same list
        (a plan of only the decode phase's rows shares the phase's list, which is
        replaced, never edited, when rows join or leave)."""
        n = plan.num_decodes
        ids = plan.seq_ids
        cached = self._rows
        if cached is not None and cached[0] is ids and n == len(ids):
            return cached[1]
        seqs = plan.seqs[:n]
        keys = [self.key_of(s.seq_id, s.request_id, s.sample_index) for s in seqs]
        offsets = [1 - s.num_prompt_tokens for s in seqs]
        wide = n > SCALAR_ROWS
        rows = DecodeRows(
            keys,
            offsets,
            np.array(keys, dtype=np.uint64) if wide else None,
            np.array(offsets, dtype=np.int64) if wide else None,
        )
        if n == len(ids):
            self._rows = (ids, rows)
        return rows

    def key_of(self, seq_id: int, request_id: str, sample_index: int) -> int:
        key = self._keys.get(seq_id)
        if key is None:
            key = self._keys[seq_id] = sequence_key(request_id, sample_index)
        return key

    def avoid_eos(self, tokens: list[int], vocab: int) -> list[int]:
        """Requests end at max_tokens, never at a stand-in EOS: an EOS becomes the next id."""
        return avoid_eos(tokens, vocab, self.eos)


@hookimpl
def servelab_register_executors() -> dict[str, type]:
    return {"simulated": SimulatedExecutor}


@hookimpl
def servelab_engine_ready(engine: Any) -> None:
    """A simulated executor prices its engine's proposer's draft model (if it has one):
    the engine builds the two apart, and this is where they first meet."""
    executor = engine.executor
    if isinstance(executor, SimulatedExecutor):
        speculation = getattr(engine.scheduler, "speculation", None)
        executor.price_drafts(getattr(speculation, "proposer", None))
