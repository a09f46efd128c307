"""`round_robin`: replicas in turn, blind to load and cache; the baseline every router is
measured against."""

from collections.abc import Sequence

from servelab.contracts.hookspecs import hookimpl
from servelab.contracts.router import ReplicaState, RoutedRequest, Router


class RoundRobinRouter(Router):
    description = "replicas in turn"

    def __init__(self, num_replicas: int) -> None:
        super().__init__(num_replicas)
        self.next = 0

    def route(self, request: RoutedRequest, replicas: Sequence[ReplicaState]) -> int:
        chosen = self.next % len(replicas)
        self.next = chosen + 1
        return chosen


@hookimpl
def servelab_register_routers():
    return {"round_robin": RoundRobinRouter}
