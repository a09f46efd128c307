"""`StepUpdate`: the half of `SchedulerCore` that runs after the forward.

`update` advances every scheduled sequence, appends its sampled tokens (forking
a group whose prompt just finished into its n samples), applies the stop rules,
frees the finished (unless the policy's `keeps_slot` holds them), keeps the
decode batch (`servelab.step.decode_batch`) in step with the running
sequences, then calls the policy's `on_step_end` and `on_request_end`. It reads
and writes `SchedulerCore`'s queues and limits; it is a part of that class,
kept in its own module.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import numpy as np

from servelab.step.decode_batch import DecodeBatch
from servelab.step.plan import SampledTokens, StepPlan
from servelab.step.sequence import FinishReason, Sequence, SequenceGroup, SequenceStatus

if TYPE_CHECKING:
    from servelab.contracts.allocator import KVAllocator


class StepUpdate:
    """`update` and what it needs; mixed into `SchedulerCore`."""

    if TYPE_CHECKING:

        @property
        def num_running_seqs(self) -> int: ...

    allocator: KVAllocator
    running: list[SequenceGroup]
    swapped: list[SequenceGroup]
    cache_full: list[SequenceGroup]
    decode_batch: DecodeBatch | None
    decode_fast_path: bool
    max_num_batched_tokens: int
    max_model_len: int
    _holds_slots: bool
    _release_group: Callable[[SequenceGroup], None]
    keeps_slot: Callable[[SequenceGroup], bool]
    on_step_end: Callable[[StepPlan, list[SequenceGroup]], None]
    on_request_end: Callable[[SequenceGroup], None]

    def update(
        self, plan: StepPlan, sampled: Mapping[int, list[int]], now: float
    ) -> list[SequenceGroup]:
        """Advances every scheduled sequence, appends sampled tokens (forking a
        group whose prompt just finished), applies stop rules and frees the
        finished. Returns the groups that finished in this step."""
        finished, self.cache_full = self.cache_full, []
        stopped: set[SequenceGroup] = set()  # groups with a sequence finished in this step
        if plan.decodes is not None:
            self._update_decode_batch(plan, sampled, now, stopped)
        forked = False
        for item in plan.items:
            seq = item.seq
            seq.num_computed_tokens += item.num_query_tokens
            self.allocator.commit(seq)
            tokens = sampled.get(seq.seq_id)
            if tokens is None:
                continue
            targets = [seq] + self._fork(seq, len(tokens) - 1)
            forked = forked or len(targets) > 1
            for target, token in zip(targets, tokens):
                target.append_token(token)
                target.token_times.append(now)
                reason = self._stop_reason(target)
                if reason is not None:
                    self._finish(target, reason)
                    assert target.group is not None  # a queued sequence belongs to its group
                    stopped.add(target.group)
        if stopped or self._holds_slots:
            for group in list(self.running):  # in queue order
                if not group.is_finished or (group not in stopped and not self._holds_slots):
                    continue
                if self._holds_slots and self.keeps_slot(group):
                    continue
                self.running.remove(group)
                self._release_group(group)
                finished.append(group)
        self._refresh_decode_batch(plan, forked)
        self.on_step_end(plan, finished)
        for group in finished:
            self.on_request_end(group)
        return finished

    def _update_decode_batch(
        self,
        plan: StepPlan,
        sampled: Mapping[int, list[int]],
        now: float,
        stopped: set[SequenceGroup],
    ) -> None:
        """`update` for the plan's decode-batch rows: their tokens come first in
        `sampled`, one per row."""
        batch = plan.decodes
        rows = plan.num_batch_decodes
        if isinstance(sampled, SampledTokens):
            tokens = sampled.tokens[:rows]
        else:  # a mapping seq_id -> [token] (tests, stub models)
            tokens = [sampled[seq_id][0] for seq_id in batch.seq_ids]
        written, filled = batch.written_blocks(plan.decode_starts)
        candidates = batch.advance(tokens, now)
        if self.allocator.commit_decodes(batch.seqs, written, filled):
            self.decode_batch = None  # its copies of the block tables are stale: rebuilt next step
        ending = []
        for row, seq in candidates:
            reason = self._stop_reason(seq)
            if reason is not None:
                self._finish(seq, reason)
                stopped.add(seq.group)
                ending.append(row)
        if ending:
            keep = np.ones(len(batch), dtype=bool)
            keep[ending] = False
            batch.keep(keep)

    def _refresh_decode_batch(self, plan: StepPlan, forked: bool) -> None:
        """After a step: keeps, grows or builds the decode batch when every
        running sequence now decodes (and one does), and drops it otherwise."""
        if forked or self.swapped or not self.decode_fast_path:
            self.decode_batch = None
            return
        batch = self.decode_batch if plan.decodes is not None else None
        joining = []
        for item in plan.items:
            seq = item.seq
            if seq.is_finished:
                continue
            if not item.samples:  # a prompt still prefilling: not a decode yet
                self.decode_batch = None
                return
            joining.append(seq)
        if batch is None:
            # after a general step: the plan must have covered every running sequence
            if (
                not joining
                or self.num_running_seqs != len(joining)
                or len(joining) > self.max_num_batched_tokens
            ):
                self.decode_batch = None
                return
            self.decode_batch = DecodeBatch(
                joining,
                [self.allocator.block_table(s) for s in joining],
                self.allocator.block_size,
                self.max_model_len,
            )
        elif joining:
            if len(batch) + len(joining) > self.max_num_batched_tokens:
                self.decode_batch = None
                return
            batch.append(joining, [self.allocator.block_table(s) for s in joining])
        if self.decode_batch is not None and len(self.decode_batch) == 0:
            self.decode_batch = None  # nothing decodes: the next step admits on the general path

    def _fork(self, parent: Sequence, count: int) -> list[Sequence]:
        if count:
            self.decode_batch = None
        group = parent.group
        assert group is not None  # a queued sequence belongs to its group
        children = []
        for _ in range(count):
            index = len(group.seqs)
            child = parent.fork(index, parent.params)
            child.group = group
            self.allocator.fork(parent, child)
            group.seqs.append(child)
            children.append(child)
        return children

    def _stop_reason(self, seq: Sequence) -> FinishReason | None:
        token = seq.token_ids[-1]
        params = seq.params
        if token in params.stop_token_ids or (not params.ignore_eos and token in seq.eos_token_ids):
            return FinishReason.STOP
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Marks `seq` finished and frees its blocks at once (a group that keeps
        its slot keeps the slot, not the blocks)."""
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.allocator.free(seq)
