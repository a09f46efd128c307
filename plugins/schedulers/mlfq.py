"""`mlfq`: skip-join multi-level feedback queue with token-level preemption
(Wu et al., "Fast Distributed Inference Serving for Large Language Models",
FastServe).

Queue i (0 is the highest) has a quantum of `base_quantum * 2**i` output
tokens. Skip-join: a request enters the highest queue whose quantum covers its
first step, whose time is its prompt length over `prompt_tokens_per_step` (the
prompt tokens that cost one decode step), so a long prompt skips the queues a
short job would finish in. A request is demoted one queue each time it spends
its quantum. Work runs in queue order (then the base order): a waiting or
swapped request of a higher queue that lacks a slot or KV room preempts
running work of lower queues, lowest queue and latest arrival first, through
the configured preemption policy (swap or recompute). A request that has waited
`starvation_steps` steps is promoted to queue 0 (null: never).
"""

from __future__ import annotations

from servelab.contracts.hookspecs import hookimpl
from servelab.errors import ConfigError
from servelab.scheduling import SchedulingPolicy, cdiv, queue_key
from servelab.step.sequence import Sequence, SequenceGroup, SequenceStatus


class MultiLevelFeedbackQueue(SchedulingPolicy):
    description = "skip-join multi-level feedback queue, preempting lower queues (FastServe)"

    def __init__(
        self,
        num_queues: int = 4,
        base_quantum: int = 4,
        prompt_tokens_per_step: int = 64,
        starvation_steps: int | None = 256,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        for name, value in (
            ("num_queues", num_queues),
            ("base_quantum", base_quantum),
            ("prompt_tokens_per_step", prompt_tokens_per_step),
            ("starvation_steps", 1 if starvation_steps is None else starvation_steps),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"mlfq scheduler: {name} must be an integer >= 1, got {value!r}")
        self.num_queues = num_queues
        self.base_quantum = base_quantum
        self.prompt_tokens_per_step = prompt_tokens_per_step
        self.starvation_steps = starvation_steps
        self.level: dict[str, int] = {}  # request id -> its queue
        self.level_start: dict[str, int] = {}  # request id -> output tokens when it entered it
        self.wait_since: dict[str, int] = {}  # request id -> step it began waiting
        # this step preempts or starts with swapped groups: see admission_order
        self.preempting = False

    def quantum(self, level: int) -> int:
        return self.base_quantum * 2**level

    def on_add(self, group):  # skip-join: the highest queue whose quantum covers the first step
        first_step = group.seqs[0].num_prompt_tokens / self.prompt_tokens_per_step
        levels = [q for q in range(self.num_queues) if self.quantum(q) >= first_step]
        self.level[group.request_id] = levels[0] if levels else self.num_queues - 1
        self.level_start[group.request_id] = 0

    def rank(self, group: SequenceGroup) -> tuple:
        return (self.queue_of(group), queue_key(group))

    def admission_order(self, candidates, plan):
        """Queue order, then the base order; a group preempted in this step is no
        candidate. In a step that preempts or starts with swapped groups, swapped
        and waiting groups compete in that order (a swapped request resumes in its
        queue's turn, not first); otherwise the default rule holds first."""
        if not self.preempting and not super().admission_order(candidates, plan):
            return []
        just_preempted = {s.group for s in plan.preempted}
        rest = [g for g in candidates if g not in just_preempted]
        return sorted(rest, key=lambda g: (self.queue_of(g), self.core.order_key(g)))

    def queue_of(self, group: SequenceGroup) -> int:
        return self.level[group.request_id]

    def pick_victims(self):
        """Promotes the starved; then running groups of lower queues to preempt so that
        waiting and swapped groups of higher queues get a slot and KV room."""
        self.promote_starved()
        swapped_at_start = bool(self.core.swapped)
        victims = self.victims()
        self.preempting = bool(victims) or swapped_at_start
        return victims

    def victims(self) -> list[SequenceGroup]:
        running = sorted((g for g in self.core.running if not g.is_finished), key=self.rank)
        if not running:
            return []
        free_slots = self.core.max_num_seqs - self.core.num_running_seqs
        free_blocks = self.core.allocator.num_free_blocks
        victims: list[SequenceGroup] = []
        for group in sorted(self.core.waiting + self.core.swapped, key=self.rank):
            seqs, level = group.unfinished(), self.level[group.request_id]
            blocks = self.blocks_to_start(seqs)
            while (len(seqs) > free_slots or blocks > free_blocks) and running:
                if self.level[running[-1].request_id] <= level:
                    break
                victim = running.pop()
                victims.append(victim)
                free_slots += victim.num_unfinished
                # an estimate: blocks shared with another group (a cached prefix) stay held
                free_blocks += len(
                    {b for s in victim.unfinished() for b in self.core.allocator.block_table(s)}
                )
            if len(seqs) > free_slots or blocks > free_blocks:
                break
            free_slots -= len(seqs)
            free_blocks -= blocks
        return victims

    def promote_starved(self) -> None:
        waiting = self.core.waiting + self.core.swapped
        since = self.wait_since
        self.wait_since = {
            g.request_id: since.get(g.request_id, self.core.step_count) for g in waiting
        }
        if self.starvation_steps is None:
            return
        for group in waiting:
            rid = group.request_id
            if (
                self.level[rid]
                and self.core.step_count - self.wait_since[rid] >= self.starvation_steps
            ):
                self.level[rid] = 0
                self.level_start[rid] = max(s.num_output_tokens for s in group.seqs)
                self.wait_since[rid] = self.core.step_count

    def blocks_to_start(self, seqs: list[Sequence]) -> int:
        if seqs[0].status is SequenceStatus.SWAPPED:
            return sum(cdiv(s.num_tokens, self.core.allocator.block_size) for s in seqs)
        return sum(self.core.allocator.blocks_needed(s, s.num_tokens) for s in seqs)

    def on_step_end(self, plan, finished):  # demotion: one queue per quantum spent
        for group in self.core.running:
            rid = group.request_id
            produced = max(s.num_output_tokens for s in group.seqs)
            while self.level[rid] < self.num_queues - 1 and produced - self.level_start[
                rid
            ] >= self.quantum(self.level[rid]):
                self.level_start[rid] += self.quantum(self.level[rid])
                self.level[rid] += 1

    def on_request_end(self, group):
        for table in (self.level, self.level_start, self.wait_since):
            table.pop(group.request_id, None)


@hookimpl
def servelab_register_schedulers():
    return {"mlfq": MultiLevelFeedbackQueue}
