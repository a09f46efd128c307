"""`continuous`: iteration-level batching (Orca). Every step drops the finished
and admits waiting requests while `max_num_seqs`, the token budget and KV room
allow; prompts are prefilled whole."""

from servelab.contracts.hookspecs import hookimpl
from servelab.scheduling import SchedulingPolicy


class ContinuousScheduler(SchedulingPolicy):
    description = "iteration-level batching: admit and retire requests every step (Orca)"


@hookimpl
def servelab_register_schedulers():
    return {"continuous": ContinuousScheduler}
