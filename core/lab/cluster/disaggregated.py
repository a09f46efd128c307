"""`DisaggregatedCluster`: prefill instances and decode instances on one virtual clock.

The simulated colocated cluster's discrete-event loop (servelab.lab.cluster.simulated) with
three kinds of event: an arrival, routed by the router part to a prefill instance; the step
of the instance (prefill or decode) whose clock is furthest behind; a KV transfer's arrival
at its decode instance. A request finishing on a prefill instance has its first token; its
decode instance is picked then by the decode router (`cluster.decode_router`, default
least_load over the decode instances' outstanding tokens), and its prompt's KV lands there
`link.transfer_seconds(prompt tokens x KV bytes per token)` later (servelab.cluster.links).
The decode instance admits it through the engine's prefilled-request entry: its scheduler,
allocator and preemption decide; one that does not fit waits there or recomputes its prompt
(`cluster.transfer`). Transfers do not share a link's bandwidth (each gets all of it).
Events at one time: arrivals, then transfers, then steps; steps are atomic.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from servelab.cluster.dispatch import Dispatcher
from servelab.cluster.links import Link
from servelab.contracts.router import RoutedRequest
from servelab.engine.engine import Engine
from servelab.engine.handover import PrefilledRequest
from servelab.errors import ConfigError
from servelab.lab.arrivals import ArrivalQueue
from servelab.lab.cluster.handoff import Handoff, admit, send
from servelab.lab.cluster.simulated import IDLE_SLEEP, catch_up, routed_request
from servelab.lab.request_builder import WorkloadRequest


class DisaggregatedCluster:
    def __init__(
        self,
        prefill: Sequence[Engine],
        decode: Sequence[Engine],
        prefill_dispatcher: Dispatcher,
        decode_dispatcher: Dispatcher,
        link: Link,
        transfer: str = "wait",
    ) -> None:
        if not prefill or not decode:
            raise ConfigError("a disaggregated cluster needs a prefill and a decode instance")
        for engine in (*prefill, *decode):
            if not engine.executor.virtual_clock:
                raise ConfigError(
                    "a simulated cluster runs on a virtual clock: set executor=simulated"
                )
        self.engines = [*prefill, *decode]  # prefill instances first: index - P is the decode's
        self.num_prefill = len(prefill)
        self.prefill_dispatcher = prefill_dispatcher
        self.decode_dispatcher = decode_dispatcher
        self.link = link
        self.kv_bytes_per_token = prefill[0].executor.kv_bytes_per_token()
        self.transfer = transfer
        self.handoffs: dict[str, Handoff] = {}
        self.tokens: dict[str, list[list[int]]] = {}  # request id -> its tokens (one sample)
        self._order = 0  # transfers landing at one time land in the order they were sent

    @property
    def placement(self) -> dict[str, int]:
        return {rid: h.prefill_replica for rid, h in self.handoffs.items()}

    def run(self, requests: list[WorkloadRequest]) -> None:
        """Serves every request to the end."""
        arrivals = ArrivalQueue(requests)
        self._busy: list[tuple[float, int]] = []  # heap of (instance clock, instance) with work
        self._queued = [False] * len(self.engines)
        transfers: list[tuple[float, int, str]] = []  # heap of (arrival, order, request id)
        while arrivals or self._busy or transfers:
            next_arrival = arrivals.next_time()
            next_transfer = transfers[0][0] if transfers else None
            next_step = self._busy[0][0] if self._busy else None
            if next_arrival is not None and all(
                t is None or next_arrival <= t for t in (next_transfer, next_step)
            ):
                for req in arrivals.pop_due(next_arrival):
                    self._arrive(req, next_arrival)
                    arrivals.sent(req)
                continue
            if next_transfer is not None and (next_step is None or next_transfer <= next_step):
                _, _, request_id = heapq.heappop(transfers)
                self._land(self.handoffs[request_id], next_transfer)
                continue
            if next_step is None:
                raise RuntimeError("follow-up requests wait for requests that never ran")
            _, index = heapq.heappop(self._busy)
            engine = self.engines[index]
            before = engine.now()
            outputs = engine.step()
            if index < self.num_prefill:
                outputs = self._prefilled(engine, outputs, transfers)
            for output in outputs:
                if index >= self.num_prefill:
                    self.decode_dispatcher.finished(output.request_id)
                tokens = list(output.outputs[0].token_ids) if output.outputs else []
                self.tokens[output.request_id] = [tokens]
                arrivals.finished(output.request_id, tokens, engine.now())
            if engine.has_unfinished():
                if engine.now() == before:
                    engine.sleep(IDLE_SLEEP)
                heapq.heappush(self._busy, (engine.now(), index))
            else:
                self._queued[index] = False

    def _wake(self, index: int) -> None:
        """Puts an instance that got work on the heap (its clock caught up before the work
        came: `catch_up`)."""
        if not self._queued[index]:
            self._queued[index] = True
            heapq.heappush(self._busy, (self.engines[index].now(), index))

    def _arrive(self, req: WorkloadRequest, now: float) -> None:
        index = self.prefill_dispatcher.dispatch(routed_request(req, now))
        self.handoffs[req.request_id] = Handoff(req.request_id, index)
        catch_up(self.engines[index], now)
        send(self.engines[index], req, now)
        self._wake(index)

    def _prefilled(self, engine: Engine, outputs: list, transfers: list) -> list:
        """After a prefill instance's step: sends each finished prefill's KV to a decode
        instance; the requests that ended there (their first token ended them, or they
        failed) are returned as finished."""
        ended = {output.request_id: output for output in outputs}
        for prefilled in engine.take_prefilled():
            if prefilled.done:
                continue
            ended.pop(prefilled.request_id)
            self._send(self.handoffs[prefilled.request_id], prefilled, engine.now())
            self._order += 1
            heapq.heappush(
                transfers, (self.handoffs[prefilled.request_id].transfer_arrival, self._order,
                            prefilled.request_id),
            )  # fmt: skip
        for output in outputs:
            self.prefill_dispatcher.finished(output.request_id)
        return list(ended.values())

    def _send(self, handoff: Handoff, prefilled: PrefilledRequest, now: float) -> None:
        """The prefill is done: picks the decode instance and prices the KV's move there."""
        handoff.prefilled = prefilled
        handoff.prefill_done = now
        handoff.kv_bytes = len(prefilled.prompt_token_ids) * self.kv_bytes_per_token
        handoff.transfer_s = self.link.transfer_seconds(handoff.kv_bytes)
        routed = RoutedRequest(
            handoff.request_id,
            (*prefilled.prompt_token_ids, prefilled.first_token),
            prefilled.params.max_tokens - 1,
            now,
        )
        handoff.decode_replica = self.decode_dispatcher.dispatch(routed)

    def _land(self, handoff: Handoff, now: float) -> None:
        """The KV arrived: the decode instance queues the request (it admits it at its next
        step if it fits)."""
        index = self.num_prefill + handoff.decode_replica
        engine = self.engines[index]
        catch_up(engine, now)
        admit(engine, handoff, self.transfer)
        self.decode_dispatcher.started(handoff.request_id)
        self._wake(index)
