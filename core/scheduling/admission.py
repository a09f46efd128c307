"""`Admission`: the waiting phase of `SchedulerCore.schedule`.

The policy's `admission_order` names the groups to try, in order; each is
checked (a candidate now, not seen before in this step) and admitted only when
`max_num_seqs`, the reserve budget and the allocator allow, all blocks or none.
A group whose prompt cannot fit even an empty cache finishes as "cache_full".
Part of `SchedulerCore`, kept in its own module.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from servelab.scheduling.policy import SchedulingPolicyError
from servelab.step.plan import ScheduledSeq, StepPlan
from servelab.step.sequence import FinishReason, Sequence, SequenceGroup, SequenceStatus

if TYPE_CHECKING:
    from servelab.contracts.allocator import KVAllocator
    from servelab.step.decode_batch import DecodeBatch


def queue_key(group: SequenceGroup) -> tuple:
    """The waiting queue's order: priority, then arrival, then sequence id (a tie-break)."""
    return (group.priority, group.arrival_time, group.seqs[0].seq_id)


class Admission:
    """`_admit` and what it needs; mixed into `SchedulerCore`."""

    if TYPE_CHECKING:

        @property
        def num_running_seqs(self) -> int: ...

    allocator: KVAllocator
    waiting: list[SequenceGroup]
    running: list[SequenceGroup]
    swapped: list[SequenceGroup]
    cache_full: list[SequenceGroup]
    reserved_blocks: dict[str, int]
    decode_batch: DecodeBatch | None
    admission: str
    order: str
    max_num_seqs: int
    swapped_in_admission_order: bool
    order_key: Callable[[SequenceGroup], tuple]
    admission_order: Callable[[list[SequenceGroup], StepPlan], Iterable[SequenceGroup]]
    tokens_for: Callable[[Sequence, int, int], int]
    _finish: Callable[[Sequence, FinishReason], None]
    _resume_one: Callable[[SequenceGroup, StepPlan, int], int | None]
    _release_group: Callable[[SequenceGroup], None]
    _worst_case_blocks: Callable[[SequenceGroup], int]

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
            if not self.allocator.can_allocate(seq, target):
                for other in done:
                    self.allocator.free(other)
                    other.num_computed_tokens = 0
                return False
            cached = self.allocator.allocate(seq, target)
            seq.num_cached_tokens = cached
            seq.num_computed_tokens = max(seq.num_computed_tokens, cached)
            done.append(seq)
        return True
