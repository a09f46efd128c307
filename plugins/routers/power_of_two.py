"""`power_of_two`: two replicas drawn at random, the one with fewer outstanding tokens wins
(Mitzenmacher's power of two choices: nearly least-load balance from two probes, which is
what matters when reading every replica's state is costly). The draws come from a generator
seeded by `seed`, so a run repeats exactly."""

import random
from collections.abc import Sequence

from servelab.contracts.hookspecs import hookimpl
from servelab.contracts.router import ReplicaState, RoutedRequest, Router


class PowerOfTwoRouter(Router):
    description = "the less loaded of two random replicas"

    def __init__(self, num_replicas: int, seed: int = 0) -> None:
        super().__init__(num_replicas)
        self.rng = random.Random(seed)

    def route(self, request: RoutedRequest, replicas: Sequence[ReplicaState]) -> int:
        if len(replicas) == 1:
            return 0
        a, b = self.rng.sample(range(len(replicas)), 2)
        load = [(r.outstanding_tokens, r.outstanding_requests) for r in (replicas[a], replicas[b])]
        return a if (load[0], a) <= (load[1], b) else b


@hookimpl
def servelab_register_routers():
    return {"power_of_two": PowerOfTwoRouter}
