"""`Engine`: requests in, one scheduled step at a time, outputs out.

One step, as data flows (see docs/architecture.md):
    plan   = scheduler.schedule()
    executor.apply(plan.copies)             (swap-out, swap-in, copy-on-write)
    tokens = executor.execute(plan)         (inputs, the forward, sampling; or a cost model)
    done   = scheduler.update(plan, tokens)
Time is the executor's clock: the wall clock for the model, a virtual one simulated.
The engine is a step machine for one caller at a time: every finished request
comes back as the return value of `step` (a request a hook aborts during the
step included) or of `abort`. Threads, sinks and `generate` are the loop's
(`servelab.llm.EngineLoop`), which wraps an engine; the engine knows no loop.
Nothing invalid reaches a step: `new_sequence` checks every argument of a request
before it exists, and a `RequestError` names the request, the argument and what is
accepted (the checks are this module's, at its end).
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import torch

from servelab.contracts.allocator import KVAllocator
from servelab.contracts.attention import AttentionBackend
from servelab.contracts.executor import Executor
from servelab.contracts.kv_tier import KVTier
from servelab.engine import handover
from servelab.engine.failures import fail_step
from servelab.engine.grammar_queue import GrammarQueue
from servelab.engine.metrics import MetricsCollector
from servelab.engine.request_failures import fail_sampled
from servelab.engine.stops_and_logprobs import apply_stops_and_logprobs
from servelab.errors import RequestError, WorkerError
from servelab.scheduling.core import SchedulerCore
from servelab.step.plan import SampledTokens, StepPlan
from servelab.step.sequence import (
    CompletionOutput,
    FinishReason,
    RequestOutput,
    SamplingParams,
    Sequence,
    SequenceGroup,
    finite_number,
    is_integer,
)


class Events:
    """The engine's one event channel, over a plugin manager (None: no events).
    `listened(hook)` reads pluggy's own list of a hook's implementations, so an event
    no plugin implements costs the engine no call and no copy of its record;
    `notify` calls each implementation in isolation (the plugin manager's)."""

    def __init__(self, plugins: Any = None) -> None:
        # a ServelabPluginManager (not imported: the registry's hook specs name the engine)
        self.plugins = plugins

    def listened(self, hook: str) -> bool:
        """Whether a plugin implements the event hook `hook` now."""
        return self.plugins is not None and bool(getattr(self.plugins.hook, hook).get_hookimpls())

    def notify(self, hook: str, **kwargs: Any) -> None:
        if self.plugins is not None:
            self.plugins.notify(hook, **kwargs)


class Engine:
    def __init__(
        self,
        executor: Executor,
        scheduler: SchedulerCore,
        allocator: KVAllocator,
        backend: AttentionBackend,
        max_model_len: int,
        events: Events | None = None,
        config: dict | None = None,
        kv_tier: KVTier | None = None,
    ) -> None:
        self.executor = executor  # the step's tensor work (or its cost model) and the clock
        self.model_config = executor.model_config
        self.tokenizer = executor.tokenizer
        self.scheduler = scheduler
        self.allocator = allocator
        self.backend = backend
        self.kv_tier = kv_tier  # below the allocator's device cache (None: no tier)
        self.max_model_len = max_model_len
        self.config = config or {}
        self.events = events or Events()  # the event hooks: asked first, then called
        self.groups: dict[str, SequenceGroup] = {}
        self.metrics = MetricsCollector()
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids or ())
        self._request_ids = itertools.count()
        # live requests with stop strings or logprobs: only these are looked at after a step
        self.with_stops_or_logprobs: set[str] = set()
        # while a step runs: the outputs it returns (an abort from a hook lands here too)
        self._step_outputs: list[RequestOutput] | None = None
        self.step_failures: dict[tuple[str, str], int] = {}  # (stage, error type) -> count
        self._step_index = 0
        self.kv_exports: handover.KVExports | None = None  # prefill-only requests (handover)
        self.grammar_queue: GrammarQueue | None = None  # structured outputs, made on first use
        self.clock = executor.now
        self.t0 = self.clock()

    def now(self) -> float:
        return self.clock() - self.t0

    @property
    def step_index(self) -> int:
        """The number the next recorded step gets (a step that runs nothing gets none)."""
        return self._step_index

    def sleep(self, seconds: float) -> None:
        """Waits on the executor's clock (a virtual clock just moves on)."""
        self.executor.sleep(seconds)

    # -- requests
    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        client: str | None = None,
    ) -> str:
        """Validates and queues one request (`client`: who sent it, for fair
        schedulers; None is anonymous); a bad request raises RequestError and
        leaves the engine untouched (`new_sequence` checks)."""
        if request_id is None:
            request_id = self.new_request_id()
        seq = self.new_sequence(prompt, params, request_id, arrival_time, priority, client)
        request_id, params = seq.request_id, seq.params
        group = SequenceGroup(request_id, seq)
        if params.structured_outputs is not None:  # queued once its grammar is compiled
            self.grammar_queue_for_constraints().add(group)
        else:
            self.scheduler.add(group)
        self.groups[request_id] = group
        if params.stop or params.logprobs is not None:
            self.with_stops_or_logprobs.add(request_id)
        return request_id

    def new_sequence(
        self,
        prompt: Any,
        params: Any,
        request_id: Any,
        arrival_time: Any = None,
        priority: Any = 0,
        client: Any = None,
        first_token: int | None = None,
    ) -> Sequence:
        """A request's `Sequence`, every argument checked, not yet queued (RequestError:
        a bad one). `first_token`: one another instance sampled (the prompt is token ids)."""
        request_id = _checked_request_id(request_id)
        if request_id in self.groups:
            raise RequestError(f"request id {request_id!r} is already in use")
        tokenizer = self.tokenizer if first_token is None else None
        token_ids = _prompt_token_ids(prompt, tokenizer, request_id)
        with_first = token_ids if first_token is None else [*token_ids, first_token]
        _check_tokens(with_first, request_id, self.model_config.vocab_size, self.max_model_len)
        params = self.checked_params(params, request_id)
        if params.prompt_logprobs is not None and not self.executor.scores_prompts:
            raise RequestError(f"request {request_id!r}: prompt_logprobs are not supported "
                               "with tensor parallelism (engine.tensor_parallel_size > 1)")  # fmt: skip
        if not is_integer(priority):
            raise RequestError(f"request {request_id!r}: priority must be an integer (lower "
                               f"runs first), got {priority!r}")  # fmt: skip
        arrival = None if arrival_time is None else finite_number(arrival_time)
        if arrival_time is not None and arrival is None:
            raise RequestError(f"request {request_id!r}: arrival_time must be a finite number "
                               f"of seconds, got {arrival_time!r}")  # fmt: skip
        if client is not None and (not isinstance(client, str) or client == ""):
            raise RequestError(f"request {request_id!r}: client must be a non-empty string or "
                               f"None, got {client!r}")  # fmt: skip
        seq = Sequence(
            request_id,
            token_ids,
            params,
            arrival_time=self.now() if arrival is None else arrival,
            priority=int(priority),
            eos_token_ids=self.eos_token_ids,
            client=client,
        )
        if first_token is not None:
            seq.append_token(first_token)
        return seq

    def checked_params(self, params: Any, request_id: str) -> SamplingParams:
        """A validated copy of `params` (None: the defaults); its token ids in the vocabulary."""
        if params is None:
            params = SamplingParams()
        if not isinstance(params, SamplingParams):
            raise RequestError(f"request {request_id!r}: params must be a SamplingParams, got "
                               f"{type(params).__name__} (build one: SamplingParams(**options))")  # fmt: skip
        try:
            params = params.validated()
        except RequestError as err:
            raise RequestError(f"request {request_id!r}: {err}") from None
        vocab = self.model_config.vocab_size
        biased = params.logit_bias or ()
        for what, ids in (("stop token", params.stop_token_ids), ("logit_bias token", biased)):
            outside = [t for t in ids if not 0 <= t < vocab]
            if outside:
                raise RequestError(f"request {request_id!r}: {what} id {outside[0]} is outside "
                                   f"the vocabulary [0, {vocab})")  # fmt: skip
        return params

    def grammar_queue_for_constraints(self) -> GrammarQueue:
        """The engine's grammar compiler and its waiting requests (made on first use)."""
        if self.grammar_queue is None:
            self.grammar_queue = GrammarQueue(self)
        return self.grammar_queue

    def fail_unqueued(self, group: SequenceGroup, error: str) -> RequestOutput:
        """Ends a request that never reached the scheduler (its grammar did not compile)."""
        for seq in group.seqs:
            seq.finish(FinishReason.ERROR)
        return self._finish_group(group, error)

    def new_request_id(self, prefix: str = "") -> str:
        """An automatic request id (`prefix` and a counter) no request in the engine holds."""
        while True:
            request_id = f"{prefix}{next(self._request_ids)}"
            if request_id not in self.groups:
                return request_id

    def abort(self, request_id: str, error: str | None = None) -> RequestOutput | None:
        """Stops a request wherever it is (waiting, running, swapped, forked) and
        frees everything it holds. Returns its final output (finish reason
        "abort", `error` set when given), or None for an unknown or already
        finished request. Called during a step (from a hook), the output is also
        among the outputs that step returns."""
        group = self.groups.get(str(request_id))
        if group is None or group.is_finished:
            return None
        if self.grammar_queue is not None and self.grammar_queue.abort(group.request_id):
            for seq in group.seqs:  # still compiling its grammar: never queued
                seq.finish(FinishReason.ABORT)
        else:
            self.scheduler.abort(str(request_id))
        return self._finish_group(group, error)

    def has_unfinished(self) -> bool:
        waiting = self.grammar_queue is not None and bool(self.grammar_queue.waiting)
        return waiting or self.scheduler.has_unfinished()

    def output_tokens(self, request_id: str) -> list[list[int]] | None:
        """The tokens each sample of an unfinished request has so far (in sample
        order; one list before the prompt forks), or None once it finished. A
        streaming front end diffs these after every step."""
        group = self.groups.get(request_id)
        if group is None:
            return None
        return [s.output_token_ids for s in sorted(group.seqs, key=lambda s: s.sample_index)]

    def output_logprobs(self, request_id: str) -> list[list[dict] | None] | None:
        """Like `output_tokens`, the logprobs each sample has so far (asked for ones)."""
        group = self.groups.get(request_id)
        if group is None or group.params.logprobs is None:
            return None
        return [s.logprobs for s in sorted(group.seqs, key=lambda s: s.sample_index)]

    def prompt_logprobs(self, request_id: str) -> list[dict | None] | None:
        """The prompt logprobs an unfinished request asked for, once its prompt is
        computed (None before, or when not asked for)."""
        group = self.groups.get(request_id)
        first = group.seqs[0] if group is not None else None
        if first is None or first.prompt_logprobs is None:
            return None
        complete = len(first.prompt_logprobs) == first.num_prompt_tokens
        return list(first.prompt_logprobs) if complete else None

    # -- one step
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """One scheduled step; the outputs of the requests that finished in it (by
        the scheduler, a stop string, a failure, or an abort from a hook). A step
        that raises (a part's bug, a kernel error) fails only the requests it
        touched (`servelab.engine.failures`); the engine goes on serving the rest.
        A `WorkerError` (a tensor-parallel worker failed) ends the engine: it propagates."""
        outputs: list[RequestOutput] = []
        self._step_outputs = outputs
        try:
            self._step()
        finally:
            self._step_outputs = None
        return outputs

    def _step(self) -> None:
        stage, plan = "scheduler.schedule", None
        if self.grammar_queue is not None and self.grammar_queue.waiting:
            self.grammar_queue.admit(self, busy=self.scheduler.has_unfinished())
        try:
            start = self.now()
            plan = self.scheduler.schedule()
            stage = "executor.apply (block copies)"
            if plan.copies:
                self.executor.apply(plan.copies)
            stage = "the model forward (attention backend, kernels, sampler)"
            sampled = self._run(plan) if not plan.is_empty else SampledTokens([], [])
            stage = "scheduler.update"
            finished = self.scheduler.update(plan, sampled, self.now())
            if self.kv_tier is not None:
                stage = "executor.apply (a KV tier's stores of the blocks just computed)"
                completed = self.allocator.take_copies()  # a write-through tier's
                if completed:
                    self.executor.apply(completed)
            # requests whose own sampling raised fail alone (request_failures)
            failed_alone = (
                fail_sampled(self.groups, sampled, finished, self.scheduler, self.step_failures)
                if sampled.failed  # only a step whose sampling raised
                else []
            )
            stage = "stop strings and logprobs"
            if self.with_stops_or_logprobs and sampled.tokens:
                stopped, failed_scan = apply_stops_and_logprobs(
                    [self.groups[r] for r in self.with_stops_or_logprobs if r in self.groups],
                    sampled,
                    self.tokenizer,
                    self.scheduler,
                    self.step_failures,
                )
                finished, failed_alone = finished + stopped, failed_alone + failed_scan
        except WorkerError:
            raise  # the tensor-parallel group is gone: no request can run again
        except Exception as exc:
            error, touched = fail_step(
                stage,
                plan,
                exc,
                groups=self.groups,
                scheduler=self.scheduler,
                allocator=self.allocator,
                backend=self.backend,
                counts=self.step_failures,
            )
            for group in touched:
                self._finish_group(group, error)
            return
        for group in finished:
            self._finish_group(group)
        for group, message in failed_alone:
            self._finish_group(group, message)
        self._record_step(plan, sampled, start)

    def _run(self, plan: StepPlan) -> SampledTokens:
        now = None
        for seq in plan.listed:  # a sequence's first step lists it (StepPlan)
            if seq.first_scheduled_time is None:
                now = self.now() if now is None else now
                seq.first_scheduled_time = now
        if self.with_stops_or_logprobs:  # logprobs travel in the plan: the most asked for
            plan.logprobs_k = max(
                (
                    g.params.logprobs
                    for r in self.with_stops_or_logprobs
                    if (g := self.groups.get(r)) is not None and g.params.logprobs is not None
                ),
                default=-1,
            )
        sampled = self.executor.execute(plan)
        if self.kv_exports:  # prefill-only requests: their K/V, before update frees their blocks
            self.kv_exports.capture(self, plan, sampled)
        return sampled

    # -- bookkeeping
    def _finish_group(self, group: SequenceGroup, error: str | None = None) -> RequestOutput:
        """The group's final output, recorded (and among the running step's outputs)."""
        now = self.now()
        first = group.seqs[0]
        for seq in group.seqs:
            if seq.finished_time is None:
                seq.finished_time = now
        record = self.metrics.record_request(group, now, self._step_index)
        row = record.row()  # built once (it copies the record): the output and the hook share it
        output = RequestOutput(
            request_id=group.request_id,
            prompt_token_ids=first.token_ids[: first.num_prompt_tokens],
            outputs=[
                CompletionOutput(
                    index=s.sample_index,
                    token_ids=list(s.output_token_ids),
                    finish_reason=s.finish_reason.value if s.finish_reason else None,
                    text=s.stop_text
                    if s.stop_text is not None
                    else self._detokenize(s.output_token_ids),
                    logprobs=s.logprobs,
                )
                for s in sorted(group.seqs, key=lambda s: s.sample_index)
            ],
            finished=True,
            metrics=row,
            error=error,
            prompt_logprobs=first.prompt_logprobs,
        )
        del self.groups[group.request_id]
        self.with_stops_or_logprobs.discard(group.request_id)
        if self._step_outputs is not None:
            self._step_outputs.append(output)
        if self.events.listened("servelab_request_end"):
            self.events.notify("servelab_request_end", engine=self, request=dict(row))
        return output

    def _detokenize(self, token_ids: list[int]) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode(token_ids)

    def _record_step(self, plan: StepPlan, sampled: SampledTokens, start: float) -> None:
        """Records one step's figures (`servelab.engine.metrics`). A step that ran
        nothing (a batcher waiting for its batch, an idle engine) is not a step: no
        record, no hook."""
        if plan.is_empty and not plan.preempted:
            return
        record = self.metrics.record_step(
            self._step_index,
            plan,
            sampled,
            start,
            self.now,
            allocator=self.allocator,
            scheduler=self.scheduler,
            executor=self.executor,
            backend=self.backend,
            kv_tier=self.kv_tier,
        )
        self._step_index += 1
        if self.events.listened("servelab_step_end"):
            self.events.notify("servelab_step_end", engine=self, step=record.row())

    # -- prefill/decode disaggregation: servelab.engine.handover's functions, as methods
    add_prefill_request = handover.add_prefill_request
    take_prefilled = handover.take_prefilled
    add_prefilled_request = handover.add_prefilled_request


# -- the checks of a request's prompt and id (`Engine.new_sequence` runs them)
def _checked_request_id(request_id: Any) -> str:
    if not (isinstance(request_id, str) or is_integer(request_id)):
        raise RequestError(f"request_id must be a string, got {request_id!r}")
    if request_id == "":
        raise RequestError("request_id must not be empty")
    return str(request_id)


def _prompt_token_ids(prompt: Any, tokenizer: Any, request_id: str) -> list[int]:
    """The prompt as plain ints: text (with a tokenizer), a list or tuple of token ids,
    or a 1-D integer numpy array or torch tensor (a bool is not a token)."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise RequestError(
                f"request {request_id!r}: a text prompt needs a tokenizer, and this model has "
                "none (no tokenizer.json in its folder); pass token ids instead"
            )
        return list(tokenizer.encode(prompt).ids)
    if isinstance(prompt, (np.ndarray, torch.Tensor)):
        integer = (
            np.issubdtype(prompt.dtype, np.integer)
            if isinstance(prompt, np.ndarray)
            else not (prompt.dtype.is_floating_point or prompt.dtype.is_complex)
            and prompt.dtype != torch.bool
        )
        if prompt.ndim != 1 or not integer:
            raise RequestError(
                f"request {request_id!r}: a prompt array must be 1-D with an integer dtype, "
                f"got shape {tuple(prompt.shape)} and dtype {prompt.dtype}"
            )
        return [int(t) for t in prompt.tolist()]
    if not isinstance(prompt, (list, tuple)):
        raise RequestError(
            f"request {request_id!r}: a prompt is text or a list of token ids, "
            f"got {type(prompt).__name__}: {prompt!r:.80}"
        )
    if set(map(type, prompt)) <= {int}:  # the common case, without a Python check per token
        return list(prompt)
    bad = [t for t in prompt if not is_integer(t)]
    if bad:
        raise RequestError(f"request {request_id!r}: token ids must be integers, got {bad[0]!r} "
                           f"({type(bad[0]).__name__})")  # fmt: skip
    return [int(t) for t in prompt]


def _check_tokens(token_ids: list[int], request_id: str, vocab_size: int, max_model_len: int):
    if not token_ids:
        raise RequestError(f"request {request_id!r}: the prompt is empty")
    if min(token_ids) < 0 or max(token_ids) >= vocab_size:  # C passes, then the culprit
        bad = [t for t in token_ids if not 0 <= t < vocab_size]
        raise RequestError(f"request {request_id!r}: token id {bad[0]!r} is outside the "
                           f"vocabulary [0, {vocab_size})")  # fmt: skip
    if len(token_ids) > max_model_len:
        raise RequestError(f"request {request_id!r}: prompt has {len(token_ids)} tokens, "
                           f"longer than max_model_len={max_model_len}")  # fmt: skip
