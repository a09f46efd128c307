"""`static`: request-level batching, the baseline the seeds criticise. A batch
forms only when none runs; a finished sequence keeps its slot, idle, until the
whole batch ends, and its output is returned then. Idle slot-steps are counted
per step. (Its KV blocks are freed at once: holding them would only let a
preempted batch member deadlock behind its idle neighbours.)"""

from __future__ import annotations

from servelab.batch import StepPlan
from servelab.hookspecs import hookimpl
from servelab.scheduler_base import BaseScheduler
from servelab.sequence import Sequence, SequenceGroup


class StaticScheduler(BaseScheduler):
    description = "request-level batching: a new batch only when the whole previous one is done"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.batch: list[SequenceGroup] = []  # the current batch, finished members included

    def admit(self, plan: StepPlan, budget: int) -> int:
        if not self.batch:
            budget = super().admit(plan, budget)
            self.batch = list(self.running)
            return budget
        # a running batch admits nobody new, only its own preempted members
        for group in [g for g in self.waiting if g in self.batch]:
            used = self.try_admit(group, plan, budget)
            if used is None:
                break
            if group in self.waiting:
                self.waiting.remove(group)
            budget -= used
        return budget

    def schedule(self) -> StepPlan:
        plan = super().schedule()
        plan.idle_slots = sum(1 for g in self.batch for s in g.seqs if s.is_finished)
        return plan

    def group_done(self, group: SequenceGroup) -> bool:
        return False  # the whole batch ends together, in update()

    def update(self, plan, sampled, now) -> list[SequenceGroup]:
        finished = super().update(plan, sampled, now)  # only groups dropped for a full cache
        self.batch = [g for g in self.batch if g not in finished]
        if not self.batch or not all(g.is_finished for g in self.batch):
            return finished
        done, self.batch = self.batch, []
        for group in done:
            if group in self.running:
                self.running.remove(group)
            self.release_group(group)
        return finished + done

    def abort(self, request_id: str) -> list[Sequence]:
        aborted = super().abort(request_id)
        self.batch = [g for g in self.batch if g.request_id != request_id]
        return aborted


@hookimpl
def servelab_register_schedulers():
    return {"static": StaticScheduler}
