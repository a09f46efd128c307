"""What the engine does after `scheduler.update` for the requests that asked for
more than tokens: stop strings and logprobs. Both run only while a live request
uses them (`Engine.with_stops_or_logprobs`), so the offline path without them
pays nothing.

A stop string ends a sequence at the first match in its text, across token
boundaries: the token that completes the match is its last token and the text
ends before the match (vLLM's rule). The scheduler's `stop` frees its
blocks; a group whose samples have all finished leaves the queues through
`abort` (which leaves finished sequences' reasons alone), and the engine
finishes it. Only contract methods are called. Logprobs come from the
step's `SampledTokens.logprobs`, one entry per sampled token, in owner order
(a prompt that forks now owns n entries: the parent's, then its new children's).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from servelab.engine.request_failures import STOP_SCAN, Failed, failure
from servelab.engine.stop_strings import find_stop
from servelab.step.sequence import SequenceGroup

if TYPE_CHECKING:
    from servelab.scheduling.core import SchedulerCore
    from servelab.step.plan import SampledTokens


def apply_stops_and_logprobs(
    groups: list[SequenceGroup],
    sampled: SampledTokens,
    tokenizer,
    scheduler: SchedulerCore,
    failures: dict,
) -> tuple[list[SequenceGroup], list[Failed]]:
    """Records the step's logprobs and applies stop strings for `groups` (the live
    requests with either); returns the groups a stop string finished and those whose
    own scan raised (they fail alone, counted in `failures`), all already out of
    the scheduler's queues."""
    if sampled.logprobs is not None:
        _record_logprobs(groups, sampled.owners, sampled.logprobs, sampled.runs)
    if tokenizer is None:
        return [], []
    done: list[SequenceGroup] = []
    failed: list[Failed] = []
    for group in groups:
        if not group.params.stop or group.is_finished:
            continue
        try:
            if _apply_stops(group, tokenizer, scheduler):
                done.append(group)
        except Exception as exc:  # this request's scan: it fails alone (request_failures)
            scheduler.abort(group.request_id)  # frees the blocks of its unfinished samples
            failed.append(failure(group, STOP_SCAN, exc, failures))
    for group in done:
        scheduler.abort(group.request_id)  # leaves the queues; reasons stay "stop"
    return done, failed


def _record_logprobs(
    groups: list[SequenceGroup], owners: list[int], rows: list[dict], runs: frozenset[int]
) -> None:
    wanted = {s.seq_id: (g, s) for g in groups if g.params.logprobs is not None for s in g.seqs}
    if not wanted:
        return
    entries: dict[int, list[dict]] = {}
    for owner, row in zip(owners, rows):
        if owner in wanted:
            entries.setdefault(owner, []).append(row)
    for owner, got in entries.items():
        group, seq = wanted[owner]
        k = group.params.logprobs
        trimmed = [{**row, "top": row["top"][:k]} for row in got]
        # a prompt that forked this step: the parent's entry, then its children's;
        # a decode whose drafts were kept (`runs`): all its own
        if owner in runs:
            targets = [seq] * len(got)
        else:
            targets = [seq] + (group.seqs[-(len(got) - 1) :] if len(got) > 1 else [])
        for target, row in zip(targets, trimmed):  # children hold copies of the parent's list
            if target.logprobs is not None:  # a list: its request asked for logprobs
                target.logprobs.append(row)


def _apply_stops(group: SequenceGroup, tokenizer, scheduler: SchedulerCore) -> bool:
    """Finishes each sample whose text now holds a stop string; True when the
    whole group is finished."""
    for seq in group.unfinished():
        text = find_stop(seq, tokenizer)
        if text is not None:
            seq.stop_text = text
            scheduler.stop(seq)
    return group.is_finished
