"""Failing one request inside a step that worked for the others.

An error in one request's own work (its rows of the batched sampler, its stop-string
scan) fails that request only: it finishes with reason `error` and the tokens it had
before the step, its blocks are freed, and every other request of the step goes on
with exactly its tokens. A sampler error arrives in `SampledTokens.failed` (the
executor found the rows that raise alone and gave them stand-in tokens, which
`scheduler.update` appended like any token); those stand-ins are taken off again
here, so a failed request never shows a token the model did not choose for it. The
error is logged with its traceback once per stage and exception type (as a failed
step is); the output's `error` names the stage and the exception.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from servelab.step.plan import SampledTokens
from servelab.step.sequence import FinishReason, RequestOutput, SequenceGroup

if TYPE_CHECKING:
    from servelab.engine.engine import Engine

log = logging.getLogger(__name__)

SAMPLING = "sampling"
STOP_SCAN = "the stop-string scan"


def fail_sampled(
    engine: Engine, sampled: SampledTokens | dict, finished: list[SequenceGroup]
) -> list[RequestOutput]:
    """After `scheduler.update`: fails the requests whose sampling raised (taking
    their stand-in tokens off, and them out of `finished`); their outputs."""
    if not isinstance(sampled, SampledTokens) or not sampled.failed:  # the usual step
        return []
    seqs = {s.seq_id: (g, s) for g in engine.groups.values() for s in g.seqs}
    errors: dict[str, tuple[SequenceGroup, Exception]] = {}
    for owner, exc in sampled.failed.items():
        group, seq = seqs[owner]
        count = sampled.owners.count(owner)  # n entries: a prompt that forked this step
        for target in [seq] + (group.seqs[-(count - 1) :] if count > 1 else []):
            target.token_ids.pop()
            target.token_times.pop()
        errors.setdefault(group.request_id, (group, exc))
    outputs = []
    for group, exc in errors.values():
        released = group in finished  # a stand-in ended it: the scheduler released it
        if released:
            finished.remove(group)
        outputs.append(fail_request(engine, group, SAMPLING, exc, released))
    return outputs


def fail_request(
    engine: Engine, group: SequenceGroup, stage: str, exc: Exception, released: bool = False
) -> RequestOutput:
    """Fails one request: out of the scheduler (unless `released`), its blocks freed,
    reason `error`; its final output."""
    message = f"the request failed in {stage}: {type(exc).__name__}: {exc}"
    key = (stage, type(exc).__name__)
    if key not in engine.step_failures:
        log.error("servelab: %s; the other requests go on", message, exc_info=exc)
    engine.step_failures[key] = engine.step_failures.get(key, 0) + 1
    if not released:
        engine.scheduler.abort(group.request_id)  # frees the blocks of its unfinished samples
    for seq in group.seqs:
        seq.finish_reason = FinishReason.ERROR
    return engine._finish_group(group, error=message)
