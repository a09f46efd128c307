"""`sjf`: shortest job first, with ageing.

Waiting requests are admitted in order of predicted remaining work, shortest
first, so short requests stop queueing behind long ones and the mean
end-to-end latency drops. Ageing keeps that from starving a long request: each
scheduler step a request waits counts as `ageing` tokens of work already done.

Everything else — queues, KV admission, preemption, finishing — is
`BaseScheduler`'s; only the admission order changes.
"""

from __future__ import annotations

from servelab.contracts.scheduler_base import BaseScheduler
from servelab.errors import ConfigError
from servelab.step.plan import StepPlan
from servelab.step.sequence import SequenceGroup

PREDICTORS = ("max_tokens", "total")


class ShortestJobFirst(BaseScheduler):
    """Admits the waiting request with the least predicted work first; ageing prevents starvation.

    Options:
    - `predictor`: what "work" is, from what a server knows at arrival (no
      peeking at the real output length):
      `max_tokens` — output tokens still allowed (the request's own cap);
      `total` — tokens still to compute: its prompt (again, after a
      recompute preemption) plus the output tokens still allowed, times n.
    - `ageing` (>= 0): predicted tokens forgiven per step spent waiting. A
      request enqueued at step e with predicted work W is ordered by
      `W + ageing * e`, so one that arrives k steps later must predict more
      than `ageing * k` tokens less to overtake it: with `ageing > 0` a
      request waits at most about `W / ageing` steps behind newcomers. 0 is
      pure SJF (a stream of short requests can starve a long one).

    Priority still comes first: order is (priority, aged work, arrival).
    Admission stops at the first request that does not fit (as FCFS does), so
    the shortest waiting request is never overtaken by a longer one that fits.
    """

    description = "shortest job first by predicted output length, with ageing (servelab-sjf)"

    def __init__(self, *args, predictor: str = "max_tokens", ageing: float = 1.0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if predictor not in PREDICTORS:
            raise ConfigError(
                f"sjf scheduler: unknown predictor {predictor!r}; accepted: {', '.join(PREDICTORS)}"
            )
        if not isinstance(ageing, (int, float)) or ageing < 0:
            raise ConfigError(f"sjf scheduler: ageing must be a number >= 0, got {ageing!r}")
        self.predictor = predictor
        self.ageing = float(ageing)
        self.num_steps = 0  # schedule() calls so far: the clock ageing counts in
        self.enqueued_at: dict[str, int] = {}  # request -> step it first entered the queue

    # -- the clock
    def add(self, group: SequenceGroup) -> None:
        super().add(group)
        self.enqueued_at.setdefault(group.request_id, self.num_steps)

    def schedule(self) -> StepPlan:
        self.num_steps += 1
        return super().schedule()

    def release_group(self, group: SequenceGroup) -> None:
        super().release_group(group)
        self.enqueued_at.pop(group.request_id, None)

    # -- the order
    def predicted_work(self, group: SequenceGroup) -> int:
        """Tokens the group is predicted to still need (see `predictor`)."""
        seqs = group.unfinished() or group.seqs
        outputs_left = max(group.params.max_tokens - s.num_output_tokens for s in seqs)
        if self.predictor == "max_tokens":
            return outputs_left
        samples = group.params.n if group.needs_fork else len(seqs)
        return max(s.num_uncomputed_tokens for s in seqs) + outputs_left * samples

    def sjf_key(self, group: SequenceGroup) -> tuple:
        aged = self.predicted_work(group) + self.ageing * self.enqueued_at.get(
            group.request_id, self.num_steps
        )
        return (group.priority, aged, group.arrival_time, group.seqs[0].seq_id)

    def admit(self, plan: StepPlan, budget: int) -> int:
        """Admits waiting groups shortest-first while limits allow; returns the budget left."""
        for group in sorted(self.waiting, key=self.sjf_key):
            used = self.try_admit(group, plan, budget)
            if used is None:
                break
            if any(g is group for g in self.waiting):  # try_admit drops one that can never fit
                self.waiting.remove(group)
            budget -= used
        return budget

    def stats(self) -> dict[str, float]:
        return {**super().stats(), "sjf_steps": self.num_steps}
