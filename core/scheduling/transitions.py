"""`QueueTransitions`: how `SchedulerCore` moves groups between its queues
around the forward: waiting -> running before it, running -> finished after it.

Admission (the waiting phase of `schedule`): the policy's `admission_order`
names the groups to try, in order; each is checked (a candidate now, not seen
before in this step) and admitted only when `max_num_seqs`, the reserve budget
and the allocator allow, all blocks or none. A group whose prompt cannot fit
even an empty cache finishes as "cache_full".

The update (`update`, after the forward): every scheduled sequence advances and
appends its sampled tokens (a group whose prompt just finished forks into its n
samples), the stop rules apply, the finished are freed (unless the policy's
`keeps_slot` holds them), the decode batch (`servelab.step.decode_batch`) is
kept in step with the running sequences, then the policy's `on_step_end` and
`on_request_end` run. Part of `SchedulerCore`, kept in its own module.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import numpy as np

from servelab.scheduling.policy import SchedulingPolicyError
from servelab.step.decode_batch import DecodeBatch
from servelab.step.plan import SampledTokens, ScheduledSeq, StepPlan
from servelab.step.sequence import FinishReason, Sequence, SequenceGroup, SequenceStatus

if TYPE_CHECKING:
    from servelab.contracts.allocator import KVAllocator


def queue_key(group: SequenceGroup) -> tuple:
    """The waiting queue's order: priority, then arrival, then sequence id (a tie-break)."""
    return (group.priority, group.arrival_time, group.seqs[0].seq_id)


class CoreState:
    """What `SchedulerCore`'s mixins read and write of its state (declarations
    for the type checker; `SchedulerCore.__init__` sets them)."""

    if TYPE_CHECKING:

        @property
        def num_running_seqs(self) -> int: ...

    allocator: KVAllocator
    waiting: list[SequenceGroup]
    running: list[SequenceGroup]
    swapped: list[SequenceGroup]
    reserved_blocks: dict[str, int]
    decode_batch: DecodeBatch | None
    admission: str
    max_num_seqs: int
    max_model_len: int
    on_request_end: Callable[[SequenceGroup], None]
    _worst_case_blocks: Callable[[SequenceGroup], int]


class QueueTransitions(CoreState):
    """Admission (`_admit`) and `update`; mixed into `SchedulerCore`."""

    cache_full: list[SequenceGroup]
    decode_fast_path: bool
    order: str
    max_num_batched_tokens: int
    swapped_in_admission_order: bool
    _holds_slots: bool
    order_key: Callable[[SequenceGroup], tuple]
    admission_order: Callable[[list[SequenceGroup], StepPlan], Iterable[SequenceGroup]]
    tokens_for: Callable[[Sequence, int, int], int]
    keeps_slot: Callable[[SequenceGroup], bool]
    on_step_end: Callable[[StepPlan, list[SequenceGroup]], None]
    _resume_one: Callable[[SequenceGroup, StepPlan, int], int | None]
    _release_group: Callable[[SequenceGroup], None]

    # -- admission: waiting -> running
    def _admit(self, plan: StepPlan, budget: int) -> int:
        """Admits the policy's `admission_order` one group at a time until one does not fit."""
        candidates: list[SequenceGroup] = self.waiting
        if self.swapped_in_admission_order:  # see SchedulingPolicy.swapped_in_admission_order
            just_preempted = {s.group for s in plan.preempted}
            candidates = [g for g in self.waiting + self.swapped if g not in just_preempted]
            candidates.sort(key=self.order_key)
        elif self.order != "fcfs":
            candidates = sorted(candidates, key=self.order_key)
        allowed = set(candidates)
        for group in self._checked(self.admission_order(list(candidates), plan), allowed):
            if group in self.swapped:
                used = self._resume_one(group, plan, budget)
            else:
                used = self._admit_one(group, plan, budget)
            if used is None:
                break
            budget -= used
        return budget

    def _checked(
        self, order: Iterable[SequenceGroup], allowed: set[SequenceGroup]
    ) -> Iterable[SequenceGroup]:
        """The policy's order, refusing a group that was not a candidate or came twice."""
        for group in order:
            if group not in allowed:
                raise SchedulingPolicyError(
                    f"{type(self).__name__}.admission_order returned request "
                    f"{group.request_id!r}, which is not a candidate to admit now (it is "
                    "already admitted, returned twice, or was never queued)"
                )
            allowed.discard(group)
            yield group

    def _admit_one(self, group: SequenceGroup, plan: StepPlan, budget: int) -> int | None:
        """Admits one waiting group if limits allow; returns tokens scheduled, None if not."""
        seqs = group.unfinished()
        batch = self.decode_batch  # its rows are running: a cheap first check
        if batch is not None and len(batch) + len(seqs) > self.max_num_seqs:
            return None
        if self.num_running_seqs + len(seqs) > self.max_num_seqs:
            return None
        if self.admission == "reserve":
            need = self._worst_case_blocks(group)
            if sum(self.reserved_blocks.values()) + need > self.allocator.num_blocks:
                return None
        starts = [max(s.num_computed_tokens, self.allocator.match_prefix(s)) for s in seqs]
        if plan.is_empty:
            # first in the step: a recomputing group of n samples may exceed the
            # budget on its own, and would otherwise never be admitted
            budget = max(budget, sum(s.num_tokens - st for s, st in zip(seqs, starts)))
        counts: list[int] = []
        for seq, start in zip(seqs, starts):
            counts.append(self._tokens(seq, start, budget - sum(counts)))
        if 0 in counts:
            return None
        if not self._allocate_fresh(seqs, [s + c for s, c in zip(starts, counts)]):
            if self.allocator.num_free_blocks == self.allocator.num_blocks:
                for seq in seqs:  # an empty cache cannot hold it: it can never run
                    self._finish(seq, FinishReason.CACHE_FULL)
                self.waiting.remove(group)
                self._release_group(group)
                self.cache_full.append(group)
                return 0
            return None
        if self.admission == "reserve":
            self.reserved_blocks[group.request_id] = self._worst_case_blocks(group)
        for seq, count in zip(seqs, counts):
            seq.status = SequenceStatus.RUNNING
            plan.items.append(ScheduledSeq(seq, count))
        self.waiting.remove(group)
        self.running.append(group)
        return sum(counts)

    def _tokens(self, seq: Sequence, start: int, budget: int) -> int:
        count = self.tokens_for(seq, start, budget)
        if not isinstance(count, int) or not 0 <= count <= min(seq.num_tokens - start, budget):
            raise SchedulingPolicyError(
                f"{type(self).__name__}.tokens_for returned {count!r} for request "
                f"{seq.request_id!r}; it must be an integer from 0 to "
                f"min(tokens left {seq.num_tokens - start}, budget {budget})"
            )
        return count

    def _allocate_fresh(self, seqs: list[Sequence], targets: list[int]) -> bool:
        """Allocates sequences that hold no blocks yet (all or none)."""
        done: list[Sequence] = []
        for seq, target in zip(seqs, targets):
            if self.allocator.blocks_needed(seq, target) > self.allocator.num_free_blocks:
                for other in done:
                    self.allocator.free(other)
                    other.num_computed_tokens = 0
                return False
            cached = self.allocator.allocate(seq, target)
            seq.num_cached_tokens = cached
            seq.num_computed_tokens = max(seq.num_computed_tokens, cached)
            done.append(seq)
        return True

    # -- the update: running -> finished
    def update(self, plan: StepPlan, sampled: SampledTokens, now: float) -> list[SequenceGroup]:
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
        sampled: SampledTokens,
        now: float,
        stopped: set[SequenceGroup],
    ) -> None:
        """`update` for the plan's decode-batch rows: their tokens come first in
        `sampled`, one per row."""
        batch = plan.decodes
        rows = plan.num_batch_decodes
        tokens = sampled.tokens[:rows]
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
