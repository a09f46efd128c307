"""Failing one request inside a step that worked for the others.

An error in one request's own work (its rows of the batched sampler, its stop-string
scan) fails that request only: it finishes with reason `error` and the tokens it had
before the step, its blocks are freed, and every other request of the step goes on
with exactly its tokens. A sampler error arrives in `SampledTokens.failed` (the
executor found the rows that raise alone and gave them stand-in tokens, which
`scheduler.update` appended like any token); those stand-ins are taken off again
here, so a failed request never shows a token the model did not choose for it. The
error is logged with its traceback once per stage and exception type (as a failed
step is); the output's `error` names the stage and the exception. Only contract
methods are called: the engine finishes the groups handed back.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, NamedTuple

from servelab.step.sequence import FinishReason, SequenceGroup

if TYPE_CHECKING:
    from servelab.scheduling.core import SchedulerCore
    from servelab.step.plan import SampledTokens

log = logging.getLogger(__name__)

SAMPLING = "sampling"
STOP_SCAN = "the stop-string scan"


class Failed(NamedTuple):
    """A request that failed alone, out of the scheduler: the engine finishes it."""

    group: SequenceGroup
    error: str


def fail_sampled(
    groups: Mapping[str, SequenceGroup],
    sampled: SampledTokens,
    finished: list[SequenceGroup],
    scheduler: SchedulerCore,
    failures: dict,
) -> list[Failed]:
    """After `scheduler.update`: the requests whose sampling raised, their stand-in
    tokens taken off, out of the scheduler and out of `finished`."""
    if not sampled.failed:  # the usual step
        return []
    seqs = {s.seq_id: (g, s) for g in groups.values() for s in g.seqs}
    errors: dict[str, tuple[SequenceGroup, Exception]] = {}
    for owner, exc in sampled.failed.items():
        group, seq = seqs[owner]
        count = sampled.owners.count(owner)  # n entries: a prompt that forked this step
        for target in [seq] + (group.seqs[-(count - 1) :] if count > 1 else []):
            target.token_ids.pop()
            target.token_times.pop()
        errors.setdefault(group.request_id, (group, exc))
    failed = []
    for group, exc in errors.values():
        if group in finished:  # a stand-in ended it: the scheduler released it already
            finished.remove(group)
        else:
            scheduler.abort(group.request_id)  # frees the blocks of its unfinished samples
        failed.append(failure(group, SAMPLING, exc, failures))
    return failed


def failure(group: SequenceGroup, stage: str, exc: Exception, failures: dict) -> Failed:
    """Marks `group` failed in `stage` (logged once per stage and exception type,
    counted in `failures`); what the engine finishes it with."""
    message = f"the request failed in {stage}: {type(exc).__name__}: {exc}"
    key = (stage, type(exc).__name__)
    if key not in failures:
        log.error("servelab: %s; the other requests go on", message, exc_info=exc)
    failures[key] = failures.get(key, 0) + 1
    for seq in group.seqs:
        seq.finish_reason = FinishReason.ERROR
    return Failed(group, message)
