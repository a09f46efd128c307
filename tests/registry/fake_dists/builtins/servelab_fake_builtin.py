"""Stands in for a built-in plugin module (listed in DEFAULT_PLUGINS by the tests)."""

from servelab import hookimpl
from servelab.contracts.preemption import PreemptionPolicy

STEPS_SEEN: list[dict] = []


class LastInFirstOut(PreemptionPolicy):
    """Preempts the latest arrival (a fake: it frees nothing)."""

    def __init__(self, max_victims: int = 1):
        self.max_victims = max_victims

    def preempt(self, group, allocator):
        return "waiting"


@hookimpl
def servelab_register_preemption_policies():
    return {"fake_lifo": LastInFirstOut}


@hookimpl
def servelab_step_end(engine, step):
    STEPS_SEEN.append(step)
