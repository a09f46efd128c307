"""`least_load`: the replica with the fewest outstanding tokens (queued prompt tokens plus
tokens its running requests still hold or owe); ties go to the lower index."""

from collections.abc import Sequence

from servelab.contracts.hookspecs import hookimpl
from servelab.contracts.router import ReplicaState, RoutedRequest, Router


def least_loaded(replicas: Sequence[ReplicaState]) -> int:
    """Index of the replica with the fewest outstanding tokens, then requests, then lowest index."""
    best = min(replicas, key=lambda r: (r.outstanding_tokens, r.outstanding_requests, r.index))
    return best.index


class LeastLoadRouter(Router):
    description = "fewest outstanding tokens"

    def route(self, request: RoutedRequest, replicas: Sequence[ReplicaState]) -> int:
        return least_loaded(replicas)


@hookimpl
def servelab_register_routers():
    return {"least_load": LeastLoadRouter}
