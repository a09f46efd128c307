"""One API request's engine requests, submitted at once, their Deltas on one queue.

The requests are submitted when the `Submission` is made, in the same event-loop turn
as the admission check that counted them, so no other request can slip in between
(the queue limit holds exactly). Each Delta arrives as `(prompt index, Delta)` on the
submission's asyncio queue, put there from the engine thread. Other events can be
put on the same queue: `GONE` (the client left) and `CLOSING` (the server shuts down);
`events()` ends on either, and closing the submission aborts its unfinished requests.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from servelab.llm import Delta, Sink

GONE = "gone"
CLOSING = "closing"


class _QueueSink(Sink):
    streaming = True
    detached = True  # an asyncio task cannot drive the loop: stopping aborts it

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, index: int):
        self.loop, self.queue, self.index = loop, queue, index

    def put(self, delta: Delta) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (self.index, delta))
        except RuntimeError:  # the event loop closed: nobody is listening any more
            pass


class Submission:
    """`events()` yields (prompt index, Delta) until every request finished, or a
    GONE / CLOSING marker as (marker, None) and stops; `close()` aborts the rest."""

    def __init__(self, aengine, base_id: str, prompts, params, priority: int,
                 live: set) -> None:  # fmt: skip
        self.aengine, self.live = aengine, live  # live: the server's open submissions
        self.queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        self.ids = [f"{base_id}-{i}" for i in range(len(prompts))]
        self.unfinished = set(self.ids)
        for i, (request_id, prompt, p) in enumerate(zip(self.ids, prompts, params, strict=True)):
            aengine.loop.submit(request_id, prompt, p, priority, _QueueSink(loop, self.queue, i))
        live.add(self)

    def mark(self, marker: str) -> None:
        self.queue.put_nowait((marker, None))

    async def events(self) -> AsyncIterator[tuple]:
        while self.unfinished:
            item = await self.queue.get()
            if item[1] is None:
                yield item
                return
            if item[1].finished:
                self.unfinished.discard(item[1].request_id)
            yield item

    def close(self) -> None:
        """Aborts the requests not finished (a client gone, a shutdown); idempotent."""
        self.live.discard(self)
        for request_id in self.unfinished:
            self.aengine.abort(request_id)
        self.unfinished = set()


def mark_all(live: set, marker: str = CLOSING) -> None:
    """Tells every open submission (each ends its stream or response)."""
    for submission in list(live):
        submission.mark(marker)
