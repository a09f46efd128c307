"""`SimulatedCluster`: N engines behind a router on one virtual clock.

Each replica is a whole engine built from the same config (its scheduler, allocator and
preemption are the real parts; `executor=simulated` gives it a virtual clock), and the
cluster interleaves them as one discrete-event simulation: the next thing to happen is
either the next arrival or the step of the replica whose clock is furthest behind. An
arrival is routed (servelab.cluster.dispatch) with the state the cluster knows at its time
and joins its replica at that replica's next step (steps are atomic; an idle replica's
clock jumps to the arrival first). Follow-up requests (multi-turn workloads) become due when
the request they follow finishes, as in the single-engine runner. Only public engine methods
are used: add_request, step, has_unfinished, now, sleep, and the metrics it records.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from servelab.cluster.dispatch import Dispatcher
from servelab.contracts.router import RoutedRequest
from servelab.engine.engine import Engine
from servelab.errors import ConfigError
from servelab.lab.arrivals import ArrivalQueue
from servelab.lab.request_builder import WorkloadRequest

IDLE_SLEEP = 0.0005  # a replica whose step ran nothing (a batcher waiting) moves on this much


class SimulatedCluster:
    def __init__(self, engines: Sequence[Engine], dispatcher: Dispatcher) -> None:
        if not engines:
            raise ConfigError("a cluster needs at least one replica")
        for engine in engines:
            if not engine.executor.virtual_clock:
                raise ConfigError(
                    "a simulated cluster runs on a virtual clock: set executor=simulated "
                    "(real replicas are served by `servelab route`)"
                )
        self.engines = list(engines)
        self.dispatcher = dispatcher
        self.placement: dict[str, int] = {}  # request id -> replica
        self.tokens: dict[str, list[list[int]]] = {}  # request id -> each sample's tokens

    def run(self, requests: list[WorkloadRequest]) -> None:
        """Serves every request to the end."""
        arrivals = ArrivalQueue(requests)
        busy: list[tuple[float, int]] = []  # heap of (replica clock, replica) with work
        queued = [False] * len(self.engines)
        while arrivals or busy:
            next_arrival = arrivals.next_time()
            if next_arrival is not None and (not busy or next_arrival <= busy[0][0]):
                for req in arrivals.pop_due(next_arrival):
                    index = self._admit(req, next_arrival)
                    arrivals.sent(req)
                    if not queued[index]:
                        queued[index] = True
                        heapq.heappush(busy, (self.engines[index].now(), index))
                continue
            if not busy:
                raise RuntimeError("follow-up requests wait for requests that never ran")
            _, index = heapq.heappop(busy)
            engine = self.engines[index]
            before = engine.now()
            for output in engine.step():
                self.dispatcher.finished(output.request_id)
                self.tokens[output.request_id] = [o.token_ids for o in output.outputs]
                arrivals.finished(output.request_id, output.token_ids, engine.now())
            if engine.has_unfinished():
                if engine.now() == before:
                    engine.sleep(IDLE_SLEEP)
                heapq.heappush(busy, (engine.now(), index))
            else:
                queued[index] = False

    def _admit(self, req: WorkloadRequest, now: float) -> int:
        index = self.dispatcher.dispatch(routed_request(req, now))
        engine = self.engines[index]
        catch_up(engine, now)
        submit(engine.add_request, req, now)
        self.placement[req.request_id] = index
        return index


def routed_request(req: WorkloadRequest, now: float) -> RoutedRequest:
    """What the router sees of an arriving request."""
    return RoutedRequest(req.request_id, tuple(req.prompt_token_ids), req.params.max_tokens, now)


def catch_up(engine: Engine, now: float) -> None:
    """An idle replica's clock jumps to `now` (a busy one's is already there or past it)."""
    if not engine.has_unfinished() and engine.now() < now:
        engine.sleep(now - engine.now())


def submit(add, req: WorkloadRequest, now: float) -> str:
    """Hands `req`, arriving at `now`, to an engine's entry (`add_request` or another)."""
    return add(
        req.prompt_token_ids,
        req.params,
        request_id=req.request_id,
        arrival_time=now,
        priority=req.priority,
        client=req.client,
    )
