"""`AsyncEngine`: an engine's one loop (`servelab.llm.EngineLoop`) seen
from asyncio.

`start()` runs the loop on its background thread, which steps the engine while
work exists; `LLM.generate` on the same engine submits through the same loop
and waits for it. Each request added here gets an asyncio queue of `Delta`s
(its samples' new token ids every step; at the end its finish reasons and the
final `RequestOutput`), filled through the event loop it was added from. A step
that raises fails only the requests it touched (`Engine.step` does that); the
loop goes on. A request that fails validation gets one final Delta with
`error` set. Stopping the thread aborts the requests added here that are left.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from servelab.llm import Delta, EngineLoop, Sink
from servelab.step.sequence import RequestOutput, SamplingParams

__all__ = ["AsyncEngine", "Delta"]


class _AsyncSink(Sink):
    """Deltas onto an asyncio queue, from the loop's thread."""

    streaming = True
    detached = True  # an asyncio task cannot drive the loop: stopping aborts it

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue) -> None:
        self.loop, self.queue = loop, queue

    def put(self, delta: Delta) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, delta)
        except RuntimeError:  # the event loop closed: nobody is listening any more
            pass


class AsyncEngine:
    """Start with `start()`; `generate(...)` yields Deltas; `stop()` ends the loop's thread."""

    def __init__(self, loop: EngineLoop, on_step: Callable[[AsyncEngine], None] | None = None):
        self.loop = loop  # the engine's one loop: an `LLM.generate` on it shares the steps
        self.engine = loop.engine
        if on_step is not None:  # called on the loop's thread after each step (metrics)
            self.loop.on_step = lambda: on_step(self)

    @property
    def on_finish(self) -> Callable[[RequestOutput], None] | None:
        return self.loop.on_finish

    @on_finish.setter
    def on_finish(self, callback: Callable[[RequestOutput], None] | None) -> None:
        self.loop.on_finish = callback

    def problem(self) -> str | None:
        """Why the engine cannot serve (its loop's thread not running, or a failure
        that ends the engine); None when it can."""
        if not self.loop.running:
            return "the engine loop is not running"
        if self.loop.fatal is not None:
            return f"the engine failed: {self.loop.fatal}"
        return None

    @property
    def num_pending(self) -> int:
        """Requests submitted to the loop and not yet finished."""
        return self.loop.num_pending

    # -- lifecycle
    def start(self) -> None:
        self.loop.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Aborts the requests added here that are left and ends the loop's thread."""
        self.loop.stop(timeout)

    # -- from any asyncio task
    def add(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        priority: int = 0,
    ) -> asyncio.Queue:
        """Queues a request; its Deltas arrive on the returned queue (call from
        a running event loop)."""
        stream: asyncio.Queue = asyncio.Queue()
        sink = _AsyncSink(asyncio.get_running_loop(), stream)
        self.loop.submit(request_id, prompt, params, priority, sink)
        return stream

    def abort(self, request_id: str) -> None:
        self.loop.abort(request_id)

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
