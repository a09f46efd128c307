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
from typing import TYPE_CHECKING

from servelab.step.sequence import FinishReason, RequestOutput, SequenceGroup, SequenceStatus

if TYPE_CHECKING:
    from servelab.engine.engine import Engine
    from servelab.step.plan import StepPlan

log = logging.getLogger(__name__)


def fail_step(
    engine: Engine, stage: str, plan: StepPlan | None, exc: Exception
) -> list[RequestOutput]:
    """The outputs of the requests a failed step touched, each failed and freed."""
    part = _part_of(engine, stage)
    message = f"the step failed in {stage}{part}: {type(exc).__name__}: {exc}"
    key = (stage, type(exc).__name__)
    if key not in engine.step_failures:
        log.error(
            "servelab: %s; the requests it touched fail, the rest go on", message, exc_info=exc
        )
    engine.step_failures[key] = engine.step_failures.get(key, 0) + 1
    if plan is None:
        groups = list(engine.groups.values())
    else:
        ids = dict.fromkeys(s.seq.request_id for s in plan.scheduled)
        ids.update(dict.fromkeys(s.request_id for s in plan.preempted))
        groups = [engine.groups[r] for r in ids if r in engine.groups]
    outputs = []
    for group in groups:
        _drop(engine, group)
        outputs.append(engine._finish_group(group, error=message))
    return outputs


def _part_of(engine: Engine, stage: str) -> str:
    """` (scheduler 'chunked')`: the part a stage belongs to, by its registered name."""
    if stage.startswith("scheduler"):
        return (
            f" (scheduler {getattr(engine.scheduler, 'name', type(engine.scheduler).__name__)!r})"
        )
    if stage.startswith("the model forward"):
        return f" (attention {getattr(engine.backend, 'name', type(engine.backend).__name__)!r})"
    return ""


def _drop(engine: Engine, group: SequenceGroup) -> None:
    """Takes a group out of the scheduler and frees its blocks, even when the
    scheduler's own `abort` is what is broken."""
    try:
        engine.scheduler.abort(group.request_id)
    except Exception:  # a broken scheduler: free what the allocator knows of
        for queue in ("waiting", "running", "swapped"):
            members = getattr(engine.scheduler, queue, None)
            if isinstance(members, list) and group in members:
                members.remove(group)
        for seq in group.seqs:
            engine.allocator.free(seq)
    for seq in group.seqs:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = FinishReason.ERROR
