"""`Dispatcher`: the one routing path of every cluster, simulated or real.

It asks a state feed for the replicas' published states, asks the router part for a replica,
tells the router and the ledger, and logs the decision. The default feed is the ledger: what
the cluster itself knows of each replica (requests routed and not yet finished, and the
tokens each will hold at most, prompt + max_tokens; a request counts as queued until its
first token is reported, running after), which is all a proxy in front of real replicas
knows too.
A test swaps in a scripted feed, so a simulated and a real cluster see the same states and
must then make the same decisions.

A replica the proxy found dead is `down` until it answers again: a router that picks it is
overruled for the live replica with the fewest outstanding requests (counted in
`rerouted_from_down`), so no router needs to know about failures.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from servelab.contracts.router import ReplicaState, RoutedRequest, Router
from servelab.errors import ServelabError

StateFeed = Callable[[RoutedRequest], list[ReplicaState]]


@dataclass
class _Outstanding:
    replica: int
    tokens: int  # prompt + max_tokens: what the request holds at most
    started: bool = False


class ReplicaLedger:
    """Requests routed to each replica and not yet finished, as the router side counts them."""

    def __init__(self, num_replicas: int) -> None:
        self.num_replicas = num_replicas
        self.outstanding: dict[str, _Outstanding] = {}
        # [requests, tokens held at most (prompt + max_tokens)] per replica
        self._queued = [[0, 0] for _ in range(num_replicas)]
        self._running = [[0, 0] for _ in range(num_replicas)]
        self.routed_count = [0] * num_replicas
        # each replica's state as `states` publishes it, rebuilt when its counts change
        # (a request changes one replica's: a routing decision reads them all)
        self._states = [ReplicaState(i) for i in range(num_replicas)]

    def _changed(self, replica: int) -> None:
        q, r = self._queued[replica], self._running[replica]
        self._states[replica] = ReplicaState(replica, q[0], r[0], q[1], r[1])

    def routed(self, request: RoutedRequest, replica: int) -> None:
        tokens = len(request.prompt_token_ids) + request.max_tokens
        self.outstanding[request.request_id] = _Outstanding(replica, tokens)
        self._queued[replica][0] += 1
        self._queued[replica][1] += tokens
        self.routed_count[replica] += 1
        self._changed(replica)

    def started(self, request_id: str) -> None:
        """The request's first token came back: queued -> running."""
        entry = self.outstanding.get(request_id)
        if entry is None or entry.started:
            return
        entry.started = True
        self._queued[entry.replica][0] -= 1
        self._queued[entry.replica][1] -= entry.tokens
        self._running[entry.replica][0] += 1
        self._running[entry.replica][1] += entry.tokens
        self._changed(entry.replica)

    def finished(self, request_id: str) -> int | None:
        """Forgets a finished request; the replica it ran on (None if unknown)."""
        self.started(request_id)
        entry = self.outstanding.pop(request_id, None)
        if entry is None:
            return None
        self._running[entry.replica][0] -= 1
        self._running[entry.replica][1] -= entry.tokens
        self._changed(entry.replica)
        return entry.replica

    def states(self, request: RoutedRequest | None = None) -> list[ReplicaState]:
        return list(self._states)  # frozen states: shared, the list a copy


class NoLiveReplica(ServelabError):
    """Every replica is down."""


class Dispatcher:
    """Routes each arriving request through the router part; keeps the ledger and the decision log."""

    def __init__(self, router: Router, num_replicas: int, feed: StateFeed | None = None) -> None:
        self.router = router
        self.ledger = ReplicaLedger(num_replicas)
        self.feed = feed or self.ledger.states
        self.decisions: list[tuple[str, int]] = []
        # requests sent to a replica with outstanding requests while another had none: the
        # ones that may wait behind others although a replica was idle (the router's balance)
        self.sent_to_busy_while_idle = 0
        self.down: set[int] = set()  # replicas found dead and not answering since
        self.rerouted_from_down = 0

    def dispatch(self, request: RoutedRequest) -> int:
        states = self.feed(request)
        if len(self.down) >= len(states):
            raise NoLiveReplica(f"all {len(states)} replicas are down")
        replica = self.router.route(request, states)
        if not (isinstance(replica, int) and 0 <= replica < len(states)):
            name = getattr(self.router, "name", type(self.router).__name__)
            raise RuntimeError(
                f"router {name!r} returned {replica!r}; a replica index is 0..{len(states) - 1}"
            )
        if replica in self.down:
            live = [s for s in states if s.index not in self.down]
            replica = min(live, key=lambda s: (s.outstanding_requests, s.index)).index
            self.rerouted_from_down += 1
        if states[replica].outstanding_requests and any(not s.outstanding_requests for s in states):
            self.sent_to_busy_while_idle += 1
        self.router.on_routed(request, replica)
        self.ledger.routed(request, replica)
        self.decisions.append((request.request_id, replica))
        return replica

    def started(self, request_id: str) -> None:
        self.ledger.started(request_id)

    def finished(self, request_id: str) -> None:
        replica = self.ledger.finished(request_id)
        if replica is not None:
            self.router.on_finished(request_id, replica)
