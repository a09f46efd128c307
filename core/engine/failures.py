"""What the engine does when a step raises: it fails only the requests the step
touched, frees their blocks, and goes on.

A part's bug or a kernel error must not leave requests running that will never
be scheduled again, nor stop the requests it did not touch. The step's planned
sequences are failed (finish reason `error`, the output's `error` naming the
stage and the exception); when the scheduler itself raised there is no plan and
its queues cannot be trusted, so every unfinished request is failed. The error
is logged with its traceback once per stage and exception type.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

from servelab.step.sequence import FinishReason, SequenceGroup, SequenceStatus

if TYPE_CHECKING:
    from servelab.contracts.allocator import KVAllocator
    from servelab.contracts.attention import AttentionBackend
    from servelab.scheduling.core import SchedulerCore
    from servelab.step.plan import StepPlan

log = logging.getLogger(__name__)


def fail_step(
    stage: str,
    plan: StepPlan | None,
    exc: Exception,
    *,
    groups: Mapping[str, SequenceGroup],
    scheduler: SchedulerCore,
    allocator: KVAllocator,
    backend: AttentionBackend,
    counts: dict[tuple[str, str], int],
) -> tuple[str, list[SequenceGroup]]:
    """The error message and the live groups (of `groups`) the failed step touched,
    each taken out of the scheduler, freed and marked failed; the caller finishes
    them. `counts` counts failures by (stage, error type)."""
    message = f"the step failed in {stage}{_part_of(stage, scheduler, backend)}: "
    message += f"{type(exc).__name__}: {exc}"
    key = (stage, type(exc).__name__)
    if key not in counts:
        log.error(
            "servelab: %s; the requests it touched fail, the rest go on", message, exc_info=exc
        )
    counts[key] = counts.get(key, 0) + 1
    if plan is None:
        touched = list(groups.values())
    else:
        ids = dict.fromkeys(s.request_id for s in plan.seqs)
        ids.update(dict.fromkeys(s.request_id for s in plan.preempted))
        touched = [groups[r] for r in ids if r in groups]
    for group in touched:
        _remove_and_free(scheduler, allocator, group)
    return message, touched


def _part_of(stage: str, scheduler: SchedulerCore, backend: AttentionBackend) -> str:
    """` (scheduler 'chunked')`: the part a stage belongs to, by its registered name."""
    if stage.startswith("scheduler"):
        policy = scheduler.policy
        return f" (scheduler {getattr(policy, 'name', type(policy).__name__)!r})"
    if stage.startswith("the model forward"):
        return f" (attention {getattr(backend, 'name', type(backend).__name__)!r})"
    return ""


def _remove_and_free(
    scheduler: SchedulerCore, allocator: KVAllocator, group: SequenceGroup
) -> None:
    """Takes a group out of the scheduler (its `abort`) and frees its blocks. When
    the scheduler's own `abort` is what is broken, its queues cannot be trusted:
    the blocks are freed through the allocator all the same, so none leaks."""
    try:
        scheduler.abort(group.request_id)
    except Exception:
        log.exception("servelab: the scheduler's abort raised; freeing the request's blocks")
        for seq in group.seqs:
            allocator.free(seq)
    for seq in group.seqs:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = FinishReason.ERROR
