"""The router's conformance properties, run by `check_router` (servelab.testing.conformance).

A router is driven through a seeded stream of arrivals and finishes against replica states
drawn from the same seed (no engine: a router's contract is its decisions), and must:
- return an index in `range(len(replicas))`, as a plain int, for 1, 2 and 7 replicas;
- decide the same on the same calls: two fresh instances, fed the same stream, agree on
  every decision (randomness must come from a seeded generator, never the global one);
- leave its inputs alone (the replica list is the caller's);
- accept `on_routed` and `on_finished` for every request it routed.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from servelab.contracts.router import ReplicaState, RoutedRequest

REPLICA_COUNTS = (1, 2, 7)
ARRIVALS = 300


def replica_states(rng: random.Random, count: int) -> list[ReplicaState]:
    """Plausible published states: a few requests and tokens each, some replicas idle."""
    states = []
    for i in range(count):
        queued, running = rng.randint(0, 3), rng.randint(0, 8)
        states.append(ReplicaState(
            index=i,
            queued_requests=queued,
            running_requests=running,
            queued_tokens=queued * rng.randint(0, 600),
            running_tokens=running * rng.randint(0, 900),
            kv_usage=rng.random(),
        ))  # fmt: skip
    return states


def arrivals(rng: random.Random, count: int) -> list[RoutedRequest]:
    """Requests whose prompts share prefixes (a few system prompts, then own text), so a
    cache-aware router has something to find."""
    prefixes = [[rng.randrange(1000) for _ in range(rng.choice((16, 48, 96)))] for _ in range(4)]
    requests = []
    for n in range(count):
        own = [rng.randrange(1000) for _ in range(rng.randint(1, 64))]
        prompt = rng.choice(prefixes) + own if rng.random() < 0.7 else own
        requests.append(RoutedRequest(f"r{n}", tuple(prompt), rng.randint(1, 256), n * 0.01))
    return requests


def decisions(make: Callable[[int], Any], count: int, seed: int) -> list[int]:
    """Drives a fresh router over one seeded stream; checks range, type and inputs; returns its picks."""
    rng = random.Random(seed)
    router = make(count)
    picks: list[int] = []
    in_flight: list[tuple[str, int]] = []
    for request in arrivals(rng, ARRIVALS):
        states = replica_states(rng, count)
        before = list(states)
        pick = router.route(request, states)
        assert type(pick) is int, f"route returned {pick!r} ({type(pick).__name__}), not an int"
        assert 0 <= pick < count, f"route returned {pick} for {count} replicas"
        assert states == before, "route changed the replica list it was given"
        router.on_routed(request, pick)
        picks.append(pick)
        in_flight.append((request.request_id, pick))
        if rng.random() < 0.6 and in_flight:
            request_id, replica = in_flight.pop(rng.randrange(len(in_flight)))
            router.on_finished(request_id, replica)
    return picks


def check_routing(make: Callable[[int], Any]) -> list[str]:
    """Runs every property for every replica count; returns the properties that held."""
    for count in REPLICA_COUNTS:
        for seed in (0, 1):
            first, second = decisions(make, count, seed), decisions(make, count, seed)
            assert first == second, (
                f"two fresh routers fed the same calls decided differently with {count} "
                f"replicas (seed {seed}): first difference at arrival "
                f"{next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)}"
            )
    return [
        f"route returns an int in range for {', '.join(map(str, REPLICA_COUNTS))} replicas",
        "the same calls give the same decisions (two fresh instances agree)",
        "route leaves the replica list alone",
        "on_routed / on_finished accepted for every routed request",
    ]
