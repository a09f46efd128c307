"""`sjf`: shortest job first, with ageing.

Waiting requests are admitted in order of predicted remaining work, shortest
first, so short requests stop queueing behind long ones and the mean
end-to-end latency drops. Ageing keeps that from starving a long request: each
scheduler step a request waits counts as `ageing` tokens of work already done.

Everything else — queues, KV admission, preemption, finishing — is
`SchedulerCore`'s; this policy overrides four hooks: `on_add`,
`admission_order` and `on_request_end` (plus `policy_stats` for the trace).
"""

from __future__ import annotations

from servelab.errors import ConfigError
from servelab.scheduling import SchedulingPolicy
from servelab.step.sequence import SequenceGroup

PREDICTORS = ("max_tokens", "total")


class ShortestJobFirst(SchedulingPolicy):
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

    def __init__(self, predictor: str = "max_tokens", ageing: float = 1.0, **kwargs) -> None:
        super().__init__(**kwargs)
        if predictor not in PREDICTORS:
            raise ConfigError(
                f"sjf scheduler: unknown predictor {predictor!r}; accepted: {', '.join(PREDICTORS)}"
            )
        if not isinstance(ageing, (int, float)) or ageing < 0:
            raise ConfigError(f"sjf scheduler: ageing must be a number >= 0, got {ageing!r}")
        self.predictor = predictor
        self.ageing = float(ageing)
        self.enqueued_at: dict[str, int] = {}  # request -> step it first entered the queue

    def on_add(self, group):
        self.enqueued_at.setdefault(group.request_id, self.core.step_count)

    def on_request_end(self, group):
        self.enqueued_at.pop(group.request_id, None)

    def predicted_work(self, group: SequenceGroup) -> int:
        """Tokens the group is predicted to still need (see `predictor`)."""
        seqs = group.unfinished() or group.seqs
        outputs_left = max(group.params.max_tokens - s.num_output_tokens for s in seqs)
        if self.predictor == "max_tokens":
            return outputs_left
        samples = group.params.n if group.needs_fork else len(seqs)
        return max(s.num_uncomputed_tokens for s in seqs) + outputs_left * samples

    def sjf_key(self, group: SequenceGroup) -> tuple:
        enqueued = self.enqueued_at.get(group.request_id, self.core.step_count)
        aged = self.predicted_work(group) + self.ageing * enqueued
        return (group.priority, aged, group.arrival_time, group.seqs[0].seq_id)

    def admission_order(self, candidates, plan):
        # swapped requests resume first, as they come; the waiting ones shortest first
        candidates = list(super().admission_order(candidates, plan))
        swapped = [g for g in candidates if g.is_swapped]
        return swapped + sorted((g for g in candidates if not g.is_swapped), key=self.sjf_key)

    def policy_stats(self):
        return {"sjf_steps": self.core.step_count}
