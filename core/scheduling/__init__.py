"""Scheduling: `SchedulerCore` (queues, admission, block accounting, decode
batches, preemption, finishing) and the `SchedulingPolicy` hooks a scheduler
plugin overrides. See `servelab.scheduling.policy` for the hooks."""

from servelab.scheduling.core import SchedulerCore, cdiv, queue_key
from servelab.scheduling.policy import HOOKS, SchedulingPolicy, SchedulingPolicyError

__all__ = [
    "HOOKS",
    "SchedulerCore",
    "SchedulingPolicy",
    "SchedulingPolicyError",
    "cdiv",
    "queue_key",
]
