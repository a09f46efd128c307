"""Prefill/decode disaggregation, the engine's side: a prefill-only request, and a
request whose prompt K/V arrives from another instance.

Prefill instance: `Engine.add_prefill_request` queues a request that runs its prompt
and samples its first token only (`max_tokens=1`, as DistServe and vLLM's disaggregated
prefill do). In the step that samples it, before the scheduler frees its blocks, the
executor reads its prompt's K and V through the allocator's block table (`read_kv`):
`[2 (k, v), num_layers, prompt tokens, num_kv_heads, head_dim]`. After the step,
`Engine.take_prefilled` returns a `PrefilledRequest` per finished prefill: prompt,
first token, the request's own parameters, the K/V, and `done` when the first token
already ended the request (a stop token, EOS, a stop string, max_tokens=1, the length
limit), so there is nothing to hand over.

Decode instance: `Engine.add_prefilled_request` queues it as prompt + first token; the
scheduler core (`servelab.scheduling.admission`) admits it when its allocator has room,
the executor writes the K/V into the blocks it got (`write_kv`), and only decoding
remains. A simulated executor has no K/V tensors (`kv_layout` is None): `kv` is None
and only blocks and time are modelled.
Same K/V, same greedy decode: the tokens equal a colocated run's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from servelab.errors import ConfigError, RequestError
from servelab.step.sequence import FinishReason, SamplingParams, Sequence, SequenceGroup

# The engine is passed in, never imported (not even for types): handover stays
# below engine.py, whose methods these functions are (`Engine.add_prefill_request`,
# `take_prefilled`, `add_prefilled_request`), and the import graph has no cycle.
Engine = Any

if TYPE_CHECKING:
    from servelab.contracts.executor import Executor
    from servelab.step.plan import SampledTokens, StepPlan


@dataclass
class PrefilledRequest:
    """A request whose prompt one instance prefilled, as another admits it."""

    request_id: str
    prompt_token_ids: list[int]
    first_token: int  # sampled by the prefill instance
    params: SamplingParams  # the request's own (max_tokens counts the first token)
    # [2 (k, v), num_layers, len(prompt_token_ids), num_kv_heads, head_dim]; None: no content
    kv: torch.Tensor | None = None
    done: bool = False  # the first token ended the request: nothing to decode
    finish_reason: str | None = None  # the prefill-only request's, when done
    # on the clock of the engine that reads them (None: the admitting engine's now())
    arrival_time: float | None = None
    first_token_time: float | None = None
    priority: int = 0
    client: str | None = None
    first_logprobs: list[dict] | None = None  # the first token's, when logprobs were asked for


@dataclass
class _Export:
    params: SamplingParams  # the request's own
    seq: Sequence | None = None  # set when its prefill sampled (capture)
    kv: torch.Tensor | None = None
    first_token: int = -1


@dataclass
class KVExports:
    """A prefill instance's prefill-only requests, by request id (`Engine.kv_exports`)."""

    pending: dict[str, _Export] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.pending)

    def capture(self, engine: Engine, plan: StepPlan, sampled: SampledTokens) -> None:
        """After a step's forward, before its update frees anything: the K/V of each
        prefill-only request whose prompt this step completed."""
        executor = engine.executor
        for seq, start, count, _ in plan.rows(plan.num_decodes):
            export = self.pending.get(seq.request_id)
            tokens = sampled.get(seq.seq_id) if export is not None else None
            if not tokens:
                continue
            assert export is not None
            end = start + count
            export.kv = executor.read_kv(engine.allocator.block_table(seq), end)
            export.seq, export.first_token = seq, int(tokens[0])


# -- the prefill instance
def add_prefill_request(
    engine: Engine,
    prompt: Any,
    params: SamplingParams | None = None,
    request_id: str | None = None,
    arrival_time: float | None = None,
    priority: int = 0,
    client: str | None = None,
) -> str:
    """Queues a request that runs its prompt and samples its first token only;
    after the step that does, `take_prefilled` hands it (and its prompt's K/V) over."""
    _check_whole_cache(engine)
    checked = engine.checked_params(params, str(request_id))
    if checked.n != 1:
        raise RequestError(
            f"request {request_id!r}: a disaggregated request has one sample (n=1), got n={checked.n}"
        )
    # the first token exactly as a whole run samples it (min_tokens keeps masking EOS)
    first_only = dataclasses.replace(checked, max_tokens=1, min_tokens=min(checked.min_tokens, 1))
    request_id = engine.add_request(prompt, first_only, request_id, arrival_time, priority, client)
    if engine.kv_exports is None:
        engine.kv_exports = KVExports()
    engine.kv_exports.pending[request_id] = _Export(checked)
    return request_id


def take_prefilled(engine: Engine) -> list[PrefilledRequest]:
    """The prefill-only requests that finished since the last call, each once (an
    aborted or failed one is dropped: its own output says why)."""
    exports = engine.kv_exports
    if not exports:
        return []
    ready = []
    for request_id, export in list(exports.pending.items()):
        seq = export.seq
        if seq is None or not seq.is_finished:
            if seq is None and request_id not in engine.groups:
                del exports.pending[request_id]  # ended before its prefill completed
            continue
        del exports.pending[request_id]
        reason = seq.finish_reason
        if reason not in (FinishReason.STOP, FinishReason.LENGTH):
            continue
        done = (
            reason is FinishReason.STOP
            or export.params.max_tokens == 1
            or seq.num_tokens >= engine.max_model_len
        )
        ready.append(
            PrefilledRequest(
                request_id=request_id,
                prompt_token_ids=seq.token_ids[: seq.num_prompt_tokens],
                first_token=export.first_token,
                params=export.params,
                kv=export.kv,
                done=done,
                finish_reason=reason.value if done else None,
                arrival_time=seq.arrival_time,
                first_token_time=seq.token_times[0] if seq.token_times else None,
                priority=seq.priority,
                client=seq.client,
                first_logprobs=list(seq.logprobs) if seq.logprobs else None,
            )
        )
    return ready


# -- the decode instance
def add_prefilled_request(engine: Engine, request: PrefilledRequest, transfer: str = "wait") -> str:
    """Queues a request whose prompt another instance prefilled: it is admitted
    when the allocator has room (`transfer="wait"`), or, when it does not fit at
    the next step, recomputes prompt + first token as an ordinary request
    (`transfer="recompute"`); then it decodes."""
    _check_whole_cache(engine)
    if request.done:
        raise RequestError(
            f"request {request.request_id!r} already finished on its prefill instance "
            f"({request.finish_reason}): there is nothing to decode"
        )
    now = engine.now()
    seq = engine.new_sequence(
        request.prompt_token_ids,
        request.params,
        request.request_id,
        now if request.arrival_time is None else request.arrival_time,
        request.priority,
        request.client,
        first_token=request.first_token,
    )
    request_id, params, num_prompt = seq.request_id, seq.params, seq.num_prompt_tokens
    write_kv = None
    executor = engine.executor
    if executor.kv_layout(num_prompt) is not None:
        kv = _check_kv(request.kv, executor, num_prompt, request_id)

        def write_kv(seq: Sequence, start: int) -> None:
            if engine.kv_tier is not None:
                # admitting it may have evicted blocks (their stores queued) and loaded
                # some from the tier: those copies run first, then its K/V fills the rest
                queued = engine.allocator.take_copies()
                if queued:
                    executor.apply(queued)
            executor.write_kv(engine.allocator.block_table(seq), kv, start, num_prompt)

    seq.token_times.append(now if request.first_token_time is None else request.first_token_time)
    # the first token came from another instance: its step is the admitting engine's next one,
    # so the record's token_steps stay in token order
    engine.metrics.note_transferred_token(seq.seq_id, engine.step_index)
    if seq.logprobs is not None and request.first_logprobs:
        seq.logprobs = list(request.first_logprobs)
    group = SequenceGroup(request_id, seq)
    if params.structured_outputs is not None:  # its first token is in: compiled before queueing
        engine.grammar_queue_for_constraints().compile_now(group)
    engine.scheduler.add_prefilled(group, write_kv, transfer)
    engine.groups[request_id] = seq.group
    if params.stop or params.logprobs is not None:
        engine.with_stops_or_logprobs.add(request_id)
    return request_id


def _check_whole_cache(engine: Engine) -> None:
    if engine.executor.tp > 1:
        raise ConfigError(
            "prefill/decode disaggregation moves a request's whole K/V, and under tensor "
            "parallelism each rank holds a share of it: use tensor_parallel_size=1"
        )


def _check_kv(kv: Any, executor: Executor, num_tokens: int, request_id: str) -> torch.Tensor:
    """`kv`, checked to be the K/V the executor holds for `num_tokens` prompt tokens."""
    layout = executor.kv_layout(num_tokens)
    assert layout is not None
    want, dtype = layout
    if not isinstance(kv, torch.Tensor):
        raise RequestError(
            f"request {request_id!r}: this engine keeps K/V tensors, so a prefilled request "
            f"must carry its prompt's K/V as a tensor of shape {want}, got {type(kv).__name__}"
        )
    if tuple(kv.shape) != tuple(want) or kv.dtype != dtype:
        raise RequestError(
            f"request {request_id!r}: its K/V has shape {tuple(kv.shape)} and dtype {kv.dtype}; "
            f"this engine needs shape {tuple(want)} and dtype {dtype} (the same "
            "model and dtype on both instances)"
        )
    return kv
