"""The router contract: which replica of a cluster serves an arriving request.

A router sees the arriving request (`RoutedRequest`: its prompt tokens, its token budget, its
arrival time) and every replica's published state (`ReplicaState`: queued and running
requests and tokens, KV usage) and returns a replica index. What a router knows of a
replica's prefix cache it learns itself, from the requests it routed (`on_routed`), as
SGLang's router and Dynamo's KV router approximate it: the replica's real cache is not
readable over the wire. The same object decides in a simulated cluster and in `servelab
route`, so the decisions are the same code. Rules: `route` returns an index in
`range(len(replicas))`; given the same calls in the same order a router makes the same
decisions (randomness comes from a seeded generator); `route` must not mutate its inputs.

Engine-supplied context: `num_replicas` (the cluster's size).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class RoutedRequest:
    """An arriving request as a router sees it."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    arrival_time: float = 0.0


@dataclass(frozen=True)
class ReplicaState:
    """One replica's published load, as the cluster (or the proxy) knows it at routing time."""

    index: int
    queued_requests: int = 0
    running_requests: int = 0
    queued_tokens: int = 0  # prompt tokens not yet prefilled
    running_tokens: int = 0  # tokens still to be produced or held by running requests
    kv_usage: float = 0.0  # fraction of the KV cache in use, 0..1

    @property
    def outstanding_requests(self) -> int:
        return self.queued_requests + self.running_requests

    @property
    def outstanding_tokens(self) -> int:
        return self.queued_tokens + self.running_tokens


class Router(abc.ABC):
    """Picks a replica for each arriving request (see the module docstring for the rules)."""

    description: ClassVar[str] = ""

    def __init__(self, num_replicas: int) -> None:
        self.num_replicas = num_replicas

    @abc.abstractmethod
    def route(self, request: RoutedRequest, replicas: Sequence[ReplicaState]) -> int:
        """The index of the replica that serves `request`."""

    def on_routed(self, request: RoutedRequest, replica: int) -> None:
        """`request` was sent to `replica` (e.g. remember its prefix there)."""

    def on_finished(self, request_id: str, replica: int) -> None:
        """The request `request_id` finished on `replica`."""
