"""A plugin whose scheduler implements only part of the Scheduler contract."""

from servelab import hookimpl
from servelab.contracts.scheduler import Scheduler


class HalfScheduler(Scheduler):
    """Implements `add` and `abort`; the other abstract methods are missing."""

    def add(self, seq):
        pass

    def abort(self, request_id):
        return []


@hookimpl
def servelab_register_schedulers():
    return {"fake_half": HalfScheduler}
