"""`AsyncEngine`: one thread owns an `Engine` and steps it while work exists.

Requests and aborts arrive through a queue from any thread or asyncio task; the
loop applies them between steps, so the engine is only ever touched by its own
thread. After each step every tracked request gets a `Delta` (its samples' new
token ids; at the end its finish reasons and the final `RequestOutput`) on its
own asyncio queue, through the event loop it was added from. A step that raises
fails only the requests it touched (`Engine.step` does that); the loop goes on.
A request that fails validation gets one final Delta with `error` set.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from servelab.engine.engine import Engine
from servelab.errors import RequestError
from servelab.step.sequence import RequestOutput, SamplingParams

log = logging.getLogger(__name__)


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


@dataclass
class _Tracked:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    sent: list[int] = field(default_factory=list)  # tokens sent per sample


class AsyncEngine:
    """Start with `start()`; `generate(...)` yields Deltas; `stop()` ends the loop."""

    def __init__(self, engine: Engine, on_step: Callable[[AsyncEngine], None] | None = None):
        self.engine = engine
        self.on_step = on_step  # called on the loop thread after each step (metrics)
        self.on_finish: Callable[[RequestOutput], None] | None = None
        self._commands: queue.Queue = queue.Queue()
        self._tracked: dict[str, _Tracked] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.num_pending = 0  # requests added and not yet finished (read from any thread)
        self._pending_lock = threading.Lock()

    # -- lifecycle
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="servelab-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Aborts whatever is left and ends the loop thread."""
        self._commands.put(("stop", None))
        if self._thread is not None:
            self._thread.join(timeout)

    # -- from any thread or task
    def add(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        priority: int = 0,
    ) -> asyncio.Queue:
        """Queues a request; its Deltas arrive on the returned queue (call from
        a running event loop)."""
        loop = asyncio.get_running_loop()
        stream: asyncio.Queue = asyncio.Queue()
        with self._pending_lock:
            self.num_pending += 1
        self._commands.put(("add", (request_id, prompt, params, priority, _Tracked(loop, stream))))
        return stream

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    async def generate(
        self, request_id: str, prompt, params: SamplingParams, priority: int = 0
    ) -> AsyncIterator[Delta]:
        """The request's Deltas until it finishes; aborts it if the consumer leaves early."""
        stream = self.add(request_id, prompt, params, priority)
        finished = False
        try:
            while not finished:
                delta = await stream.get()
                finished = delta.finished
                yield delta
        finally:
            if not finished:  # the consumer went away (a client disconnect)
                self.abort(request_id)

    # -- the loop thread
    def _run(self) -> None:
        engine = self.engine
        while True:
            busy = engine.has_unfinished()
            try:
                command = self._commands.get(block=not busy, timeout=None if busy else 0.05)
            except queue.Empty:
                command = None
            while command is not None:
                if command[0] == "stop":
                    self._abort_all()
                    return
                self._apply(*command)
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    command = None
            if engine.has_unfinished():
                self._step()

    def _apply(self, kind: str, payload) -> None:
        if kind == "abort":
            tracked = self._tracked.get(payload)
            output = self.engine.abort(payload)
            if tracked is not None and output is not None:
                self._finish(output)
            return
        request_id, prompt, params, priority, tracked = payload
        try:
            self.engine.add_request(prompt, params, request_id=request_id, priority=priority)
        except RequestError as err:
            self._done_pending()
            self._send(tracked, Delta(request_id, finished=True, error=str(err), rejected=True))
            return
        self._tracked[request_id] = tracked

    def _step(self) -> None:
        try:
            finished = self.engine.step()
        except Exception as exc:  # the engine catches a step's errors; this is a last guard
            log.exception("servelab: the engine loop's step raised")
            finished = [self.engine.abort(r) for r in list(self._tracked)]
            for out in finished:
                if out is not None:
                    out.error = f"{type(exc).__name__}: {exc}"
            finished = [o for o in finished if o is not None]
        finished += self.engine.take_finished()
        for request_id, tracked in list(self._tracked.items()):
            tokens = self.engine.output_tokens(request_id)
            if tokens is not None:
                logprobs = self.engine.output_logprobs(request_id)
                delta = self._new_tokens(request_id, tracked, tokens, logprobs)
                if delta.new_tokens:
                    self._send(tracked, delta)
        for output in finished:
            self._finish(output)
        if self.on_step is not None:
            self.on_step(self)

    @staticmethod
    def _new_tokens(request_id: str, tracked: _Tracked, tokens: list[list[int]],
                    logprobs: list[list[dict]] | None) -> Delta:  # fmt: skip
        delta = Delta(request_id)
        while len(tracked.sent) < len(tokens):  # the prompt forked into its n samples
            tracked.sent.append(tracked.sent[0] if tracked.sent else 0)
        for index, ids in enumerate(tokens):
            sent = tracked.sent[index]
            if len(ids) > sent:
                delta.new_tokens[index] = ids[sent:]
                if logprobs is not None and logprobs[index] is not None:
                    delta.new_logprobs[index] = logprobs[index][sent : len(ids)]
                tracked.sent[index] = len(ids)
        return delta

    def _finish(self, output: RequestOutput) -> None:
        tracked = self._tracked.pop(output.request_id, None)
        if tracked is None:
            return
        delta = self._new_tokens(
            output.request_id,
            tracked,
            [c.token_ids for c in output.outputs],
            [c.logprobs for c in output.outputs],
        )
        delta.finished, delta.output, delta.error = True, output, output.error
        self._done_pending()
        if self.on_finish is not None:
            self.on_finish(output)
        self._send(tracked, delta)

    def _abort_all(self) -> None:
        for request_id in list(self._tracked):
            output = self.engine.abort(request_id)
            if output is not None:
                self._finish(output)

    def _done_pending(self) -> None:
        with self._pending_lock:
            self.num_pending -= 1

    @staticmethod
    def _send(tracked: _Tracked, delta: Delta) -> None:
        try:
            tracked.loop.call_soon_threadsafe(tracked.queue.put_nowait, delta)
        except RuntimeError:  # the event loop closed: nobody is listening any more
            pass
