"""Scheduling: `SchedulerCore` (queues, admission, block accounting, decode
batches, preemption, finishing), driven by a `SchedulingPolicy`, the hooks a
scheduler plugin overrides (`servelab.contracts.scheduler`)."""

from servelab.contracts.scheduler import HOOKS, SchedulingPolicy, SchedulingPolicyError
from servelab.scheduling.admission import cdiv, queue_key
from servelab.scheduling.core import SchedulerCore

__all__ = [
    "HOOKS",
    "SchedulerCore",
    "SchedulingPolicy",
    "SchedulingPolicyError",
    "cdiv",
    "queue_key",
]
