"""`LLM`: the facade. Parts are names or `{"name": ..., **options}` dicts;
engine options are keyword arguments; `executor="simulated", hardware="h100-sxm"`
runs the same parts against a cost model.

    llm = LLM(model="tiny", scheduler="continuous", allocator="paged", dtype="float64")
    outs = llm.generate([[1, 2, 3], [4, 5]], SamplingParams(temperature=0.0, max_tokens=16))

`EngineLoop` (below) is the one loop that steps an `Engine`, whoever asks for tokens.

The loop wraps an engine (the engine knows no loop): it owns the lock that
makes one engine call at a time, the command queue and the sinks. Requests and
aborts are submitted from any thread (applied between steps); each request has
a sink that gets `Delta`s: every step's new tokens when it streams, and always a
final one with the `RequestOutput`. `LLM.generate` and the server's
`AsyncEngine` are two clients of one engine's one loop (`LLM.loop`), not two
mechanisms; an engine must have only one loop.

Who steps: one driver at a time. With a background thread running (`start`,
the server) that thread drives and `generate` waits on its own requests. With
none, `generate`'s calling thread drives until its requests are done (no
thread hop per step, so the offline path costs what a plain step loop costs);
another caller meanwhile waits, its requests batched into the same steps, and
takes over if the driver leaves first. A request finished by any route (a step,
a stop string, a failed step, an abort through the loop or from a hook during a
step) reaches its sink once, because every output comes back from `Engine.step`
or `Engine.abort`, which only the loop calls while it runs. Outputs of requests
added around the loop (`engine.add_request`) wait in `take_finished()`.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any, cast

from servelab.contracts.kinds import KINDS
from servelab.engine.build import build_engine
from servelab.engine.engine import Engine
from servelab.errors import RequestError, WorkerError
from servelab.step.sequence import RequestOutput, SamplingParams

CUDA_DTYPE = "bfloat16"  # what conf/device/cuda.yaml sets: tensor-core dots, half the KV bytes


def with_device_dtype(engine_options: dict[str, Any]) -> dict[str, Any]:
    """The options with `dtype` defaulting to bfloat16 on a CUDA device (float32 elsewhere)."""
    on_cuda = str(engine_options.get("device", "cpu")).startswith("cuda")
    if on_cuda and "dtype" not in engine_options:
        return {**engine_options, "dtype": CUDA_DTYPE}
    return engine_options


class LLM:
    def __init__(
        self,
        model: str | dict = "tiny",
        scheduler: str | dict = KINDS["scheduler"].default,
        allocator: str | dict = KINDS["allocator"].default,
        preemption: str | dict = KINDS["preemption"].default,
        attention: str | dict = KINDS["attention"].default,
        executor: str | dict = KINDS["executor"].default,
        proposer: str | dict = KINDS["proposer"].default,
        kv_tier: str | dict = KINDS["kv_tier"].default,
        hardware: str | dict | None = None,
        **engine_options: Any,
    ) -> None:
        self.engine: Engine = build_engine(
            {
                "model": model,
                "scheduler": scheduler,
                "allocator": allocator,
                "preemption": preemption,
                "attention": attention,
                "executor": executor,
                "proposer": proposer,
                "kv_tier": kv_tier,
                "hardware": hardware,
                "engine": with_device_dtype(engine_options),
            }
        )
        # the engine's one loop: `generate` and a server on this engine submit through it
        self.loop = EngineLoop(self.engine)

    def generate(
        self,
        prompts: Seq[str | list[int]] | str | list[int],
        params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            batch = [cast("str | list[int]", prompts)]
        else:
            batch = list(cast("Seq[str | list[int]]", prompts))
        return self.loop.generate(batch, params)


log = logging.getLogger(__name__)
IDLE_WAIT_S = 0.05  # an idle background loop also looks for work added around it this often


@dataclass
class Delta:
    """One step's news for one request. `new_tokens[i]`: sample i's new token ids."""

    request_id: str
    new_tokens: dict[int, list[int]] = field(default_factory=dict)
    new_logprobs: dict[int, list[dict]] = field(default_factory=dict)  # when asked for
    finished: bool = False
    output: RequestOutput | None = None  # the final output, when finished
    error: str | None = None  # a rejected request (RequestError) or a failed step
    rejected: bool = False  # the request never ran: the error is the caller's


class Sink:
    """Where a request's Deltas go. `streaming`: per-step deltas too (else only
    the final one); `detached`: its owner cannot drive the loop (an asyncio
    task), so its requests are aborted when the background thread stops."""

    streaming = False
    detached = False

    def put(self, delta: Delta) -> None:
        raise NotImplementedError


@dataclass
class _Tracked:
    sink: Sink
    sent: list[int] = field(default_factory=list)  # tokens sent per sample


class _Collector(Sink):
    """`generate`'s sink: the final outputs of its requests, in submission order."""

    def __init__(self, order: list[str], prompts: Seq, wake: threading.Condition) -> None:
        self.order, self.prompts, self.wake = order, prompts, wake
        self.outputs: dict[str, RequestOutput] = {}

    @property
    def done(self) -> bool:
        return len(self.outputs) == len(self.order)

    def put(self, delta: Delta) -> None:
        if delta.rejected:
            prompt = self.prompts[self.order.index(delta.request_id)]
            ids = prompt if isinstance(prompt, list) else []
            delta.output = RequestOutput(delta.request_id, ids, [], True, error=delta.error)
        assert delta.output is not None  # a sink hears of a request once, when it ends
        self.outputs[delta.request_id] = delta.output
        if self.done:  # a caller may be waiting on another thread's steps
            with self.wake:
                self.wake.notify_all()


class EngineLoop:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        # one engine call at a time, whichever thread makes it (re-entrant: a hook
        # that runs inside a step may submit or abort)
        self.lock = threading.RLock()
        self.on_step: Callable[[], None] | None = None  # after each step the loop runs
        self.on_finish: Callable[[RequestOutput], None] | None = None  # each tracked output
        self._commands: deque = deque()  # appends and pops are atomic: no lock per command
        self._tracked: dict[str, _Tracked] = {}  # touched under the engine's lock only
        self._streaming: dict[str, _Tracked] = {}
        self._unclaimed: list[RequestOutput] = []  # outputs of requests added around the loop
        self._driver: threading.Thread | None = None
        self._turn = threading.Condition()  # guards _driver; wakes waiting callers
        self._wake = threading.Event()  # new commands for an idle background loop
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._pending_lock = threading.Lock()
        self.num_pending = 0  # requests submitted and not yet finished (any thread reads it)
        # a failure that ends the engine (a tensor-parallel worker died): its requests fail
        # with its message, and `generate` raises it, since no later step can succeed
        self.fatal: WorkerError | None = None

    # -- from any thread
    def submit(self, request_id: str, prompt, params: SamplingParams | None, priority: int,
               sink: Sink) -> None:  # fmt: skip
        """Queues a request; its Deltas go to `sink` (a rejected one gets one
        final Delta with `rejected` set)."""
        with self._pending_lock:
            self.num_pending += 1
        self._commands.append(("add", request_id, prompt, params, priority, sink))
        self._wake.set()

    def abort(self, request_id: str) -> None:
        self._commands.append(("abort", request_id))
        self._wake.set()

    def generate(
        self,
        prompts: Seq[str | list[int]],
        params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Runs prompts to completion through the loop, one output per prompt, in
        order. A request that fails validation comes back with `error` set and
        finish reason "rejected"; the others still run."""
        if params is None or isinstance(params, SamplingParams):
            each: Seq[SamplingParams | None] = [params] * len(prompts)
        else:
            each = params
        if len(each) != len(prompts):
            raise RequestError(f"got {len(prompts)} prompts but {len(each)} SamplingParams")
        order = [self._free_id() for _ in prompts]
        collector = _Collector(order, prompts, self._turn)
        for request_id, prompt, p in zip(order, prompts, each):
            self.submit(request_id, prompt, p, 0, collector)
        self._run_until(lambda: collector.done)
        outputs = [collector.outputs[r] for r in order]
        if self.fatal is not None and any(o.error for o in outputs):
            raise self.fatal
        return outputs

    def _free_id(self) -> str:
        with self.lock:
            while True:
                request_id = self.engine.new_request_id("gen-")
                if request_id not in self._tracked:
                    return request_id

    def prompt_logprobs(self, request_id: str) -> list[dict | None] | None:
        """`Engine.prompt_logprobs` from another thread (the server's echo), under the lock."""
        with self.lock:
            return self.engine.prompt_logprobs(request_id)

    def take_finished(self) -> list[RequestOutput]:
        """Outputs of requests added with `engine.add_request` that finished while
        the loop was stepping the engine (each returned once)."""
        with self.lock:
            taken, self._unclaimed = self._unclaimed, []
            return taken

    # -- the background thread (the server)
    def start(self) -> None:
        self._stopping = False
        self._thread = threading.Thread(target=self._serve, name="servelab-engine", daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        """Whether the background thread runs."""
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout: float = 10.0) -> None:
        """Ends the background thread; it aborts the detached requests left."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def _serve(self) -> None:
        self._run_until(lambda: self._stopping, background=True)
        with self.lock:
            self._apply_commands()
            for request_id, tracked in list(self._tracked.items()):
                if tracked.sink.detached:
                    self._abort(request_id)

    # -- driving
    def _run_until(self, done: Callable[[], bool], background: bool = False) -> None:
        me = threading.current_thread()
        if self._driver is me:  # called from inside a step (a hook): drive on, nested
            self._drive(done, background)
            return
        while True:
            with self._turn:
                while not done() and self._driver is not None:
                    self._turn.wait()
                if done():
                    return
                self._driver = me
            try:
                self._drive(done, background)
            finally:
                with self._turn:
                    self._driver = None
                    self._turn.notify_all()

    def _drive(self, done: Callable[[], bool], background: bool) -> None:
        engine = self.engine
        while not done():
            if self._commands:
                with self.lock:
                    self._apply_commands()
            if engine.has_unfinished():
                self._step()
            elif self._commands:
                continue
            elif background:
                self._wake.wait(IDLE_WAIT_S)
                self._wake.clear()
            else:  # nothing left to step, yet not done: requests gone without an output
                self._finish_orphans()
                return

    def _apply_commands(self) -> None:
        while self._commands:
            command = self._commands.popleft()
            if command[0] == "abort":
                self._abort(command[1])
                continue
            _, request_id, prompt, params, priority, sink = command
            try:
                self.engine.add_request(prompt, params, request_id=request_id, priority=priority)
            except RequestError as err:
                self._done_pending()
                sink.put(Delta(request_id, finished=True, error=str(err), rejected=True))
                continue
            tracked = _Tracked(sink)
            self._tracked[request_id] = tracked
            if sink.streaming:
                self._streaming[request_id] = tracked

    def _step(self) -> None:
        engine = self.engine
        with self.lock:
            try:
                outputs = engine.step()
            except Exception as exc:  # the engine catches a step's errors; this is a last guard
                log.exception("servelab: the engine loop's step raised")
                if isinstance(exc, WorkerError):
                    self.fatal = exc
                for request_id in list(self._tracked):
                    self._abort(request_id, error=f"{type(exc).__name__}: {exc}")
                outputs = []
            for output in outputs:
                self._deliver(output)
            for request_id, tracked in list(self._streaming.items()):
                self._send_new_tokens(request_id, tracked)
            if self.on_step is not None:
                self.on_step()

    def _abort(self, request_id: str, error: str | None = None) -> None:
        output = self.engine.abort(request_id, error=error)
        if output is not None:
            self._deliver(output)

    def _send_new_tokens(self, request_id: str, tracked: _Tracked) -> None:
        tokens = self.engine.output_tokens(request_id)
        if tokens is None:
            return
        delta = _new_tokens(request_id, tracked, tokens, self.engine.output_logprobs(request_id))
        if delta.new_tokens:
            tracked.sink.put(delta)

    def _finish_orphans(self) -> None:
        """Tracked requests the engine no longer holds, their output never seen
        (aborted on the engine directly, around the loop): each ends "aborted"."""
        engine = self.engine
        with self.lock:
            for request_id in [r for r in self._tracked if r not in engine.groups]:
                tracked = self._tracked.pop(request_id)
                self._streaming.pop(request_id, None)
                self._done_pending()
                output = RequestOutput(request_id, [], [], True, error="aborted")
                tracked.sink.put(Delta(request_id, finished=True, output=output, error="aborted"))

    def _deliver(self, output: RequestOutput) -> None:
        """Hands a finished request's output to its sink, or keeps it for
        `take_finished` when the loop does not track it (under the lock)."""
        tracked = self._tracked.pop(output.request_id, None)
        if tracked is None:
            self._unclaimed.append(output)
            return
        delta = Delta(output.request_id)
        if self._streaming.pop(output.request_id, None) is not None:
            samples = output.outputs
            delta = _new_tokens(output.request_id, tracked, [c.token_ids for c in samples],
                                [c.logprobs for c in samples])  # fmt: skip
        delta.finished, delta.output, delta.error = True, output, output.error
        self._done_pending()
        if self.on_finish is not None:
            self.on_finish(output)
        tracked.sink.put(delta)

    def _done_pending(self) -> None:
        with self._pending_lock:
            self.num_pending -= 1


def _new_tokens(request_id: str, tracked: _Tracked, tokens: list[list[int]],
                logprobs: list[list[dict] | None] | None) -> Delta:  # fmt: skip
    delta = Delta(request_id)
    while len(tracked.sent) < len(tokens):  # the prompt forked into its n samples
        tracked.sent.append(tracked.sent[0] if tracked.sent else 0)
    for index, ids in enumerate(tokens):
        sent = tracked.sent[index]
        if len(ids) > sent:
            delta.new_tokens[index] = ids[sent:]
            rows = logprobs[index] if logprobs is not None else None
            if rows is not None:
                delta.new_logprobs[index] = rows[sent : len(ids)]
            tracked.sent[index] = len(ids)
    return delta
