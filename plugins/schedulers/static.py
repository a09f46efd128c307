"""`static`: request-level batching, the baseline for continuous batching. A batch forms only
when none runs; a finished sequence keeps its slot, idle, until the whole batch ends, and its
output is returned then; idle slot-steps are counted per step. Its KV blocks are freed at
once: holding them would only let a preempted batch member deadlock behind idle neighbours.

Online arrivals: with no batch running, a new one forms once `batch_size` requests wait
(`null`: `max_num_seqs`) or `batch_timeout` seconds after the oldest waiting one arrived
(`0`: at once); it takes at most `batch_size` requests and `max_num_seqs` sequences. Waiting
time runs from `add()` on the scheduler's `clock` (a class attribute, `time.perf_counter`; a
test replaces it)."""

from __future__ import annotations

import time

from servelab.contracts.hookspecs import hookimpl
from servelab.errors import ConfigError
from servelab.scheduling import SchedulingPolicy
from servelab.step.sequence import SequenceGroup, finite_number


class StaticScheduler(SchedulingPolicy):
    description = "request-level batching: a new batch only when the whole previous one is done"

    clock = staticmethod(time.perf_counter)

    def __init__(
        self, *args, batch_size: int | None = None, batch_timeout: float = 0.0, **kwargs
    ) -> None:
        super().__init__(**kwargs)
        if batch_size is not None and not (isinstance(batch_size, int) and batch_size >= 1):
            raise ConfigError(
                f"static scheduler: batch_size must be null or an integer >= 1, got {batch_size!r}"
            )
        timeout = finite_number(batch_timeout)
        if timeout is None or timeout < 0:
            raise ConfigError(
                "static scheduler: batch_timeout must be a finite number >= 0 seconds "
                f"(an infinite one would wait forever), got {batch_timeout!r}"
            )
        self.batch_size = batch_size  # None: max_num_seqs
        self.batch_timeout = float(batch_timeout)
        self.batch: list[SequenceGroup] = []  # the current batch, finished members included
        self.added_at: dict[str, float] = {}  # request id -> clock() when it was added

    @property
    def size(self) -> int:
        return self.batch_size or self.core.max_num_seqs

    def on_add(self, group):
        self.added_at[group.request_id] = self.clock()

    def batch_ready(self) -> bool:
        """Enough requests wait, or the oldest of them has waited long enough."""
        if len(self.core.waiting) >= self.size:
            return True
        oldest = min(self.added_at.get(g.request_id, 0.0) for g in self.core.waiting)
        return self.clock() - oldest >= self.batch_timeout

    def admission_order(self, candidates, plan):
        if self.batch:  # a running batch admits nobody new, only its own preempted members
            yield from [g for g in super().admission_order(candidates, plan) if g in self.batch]
            return
        if not candidates or not self.batch_ready():
            return
        for group in candidates[: self.size - len(self.core.running)]:
            yield group  # resumed only once it was admitted (or dropped: the cache is too small)
            if group in self.core.running:
                self.batch.append(group)
                self.added_at.pop(group.request_id, None)

    def keeps_slot(self, group):
        # the whole batch ends together: its finished members hold their slots until then
        return group in self.batch and not all(g.is_finished for g in self.batch)

    def on_step_end(self, plan, finished):
        if self.batch and all(g.is_finished for g in self.batch):
            self.batch = []

    def on_request_end(self, group):
        self.added_at.pop(group.request_id, None)
        if group in self.batch:
            self.batch.remove(group)


@hookimpl
def servelab_register_schedulers():
    return {"static": StaticScheduler}
