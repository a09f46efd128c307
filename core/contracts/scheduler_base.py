"""`BaseScheduler`: the queue bookkeeping every scheduler shares.

Queues hold `SequenceGroup`s (a request and, after its prompt, its n samples). `schedule()`
runs three phases (running, swapped, waiting); a built-in changes only how many tokens a
sequence may run in one step (`tokens_for`) and when new groups are admitted (`admit`).

Admission modes: `reserve` admits a group only when its worst case (prompt + max_tokens for
each of its n samples) fits next to every admitted group's, so it never preempts (blocks are
still handed out as tokens arrive); `on_demand` needs room for what runs now, and when blocks
run out the preemption policy frees a victim (lowest priority, latest arrival).

Order (every scheduler): `fcfs` admits by (priority, arrival); `lpm` by (priority, longest
prefix the allocator already caches, arrival), SGLang's cache-aware order: under memory
pressure it runs requests sharing a cached prefix together, before that prefix is evicted.
"""

from __future__ import annotations

import bisect

from servelab.contracts.allocator import KVAllocator
from servelab.contracts.preemption import PreemptionPolicy
from servelab.contracts.scheduler import Scheduler
from servelab.contracts.scheduler_update import AfterTheForward
from servelab.errors import ConfigError, RequestError
from servelab.step.decode_batch import DecodeBatch
from servelab.step.plan import ScheduledSeq, StepPlan
from servelab.step.sequence import FinishReason, Sequence, SequenceGroup, SequenceStatus

ADMISSION_MODES = ("reserve", "on_demand")
ORDERS = ("fcfs", "lpm")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def queue_key(group: SequenceGroup) -> tuple:
    return (group.priority, group.arrival_time, group.seqs[0].seq_id)


class BaseScheduler(AfterTheForward, Scheduler):
    """Shared queues, admission checks and preemption (`schedule`); appending,
    forking and finishing after the forward come from `AfterTheForward`."""

    needs_whole_prompt_budget = True  # max_num_batched_tokens must hold a whole prompt
    # steady decode phases run as a DecodeBatch (same plans, array bookkeeping);
    # False makes every step take the general path (tests compare the two)
    decode_fast_path = True

    def __init__(
        self,
        allocator: KVAllocator,
        preemption: PreemptionPolicy,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        admission: str = "on_demand",
        order: str = "fcfs",
    ) -> None:
        if order not in ORDERS:
            raise ConfigError(
                f"unknown order {order!r} for scheduler {type(self).__name__}; "
                f"accepted: {', '.join(ORDERS)}"
            )
        if admission not in ADMISSION_MODES:
            raise ConfigError(
                f"unknown admission {admission!r} for scheduler {type(self).__name__}; "
                f"accepted: {', '.join(ADMISSION_MODES)}"
            )
        if self.needs_whole_prompt_budget and max_num_batched_tokens < max_model_len:
            raise ConfigError(
                f"{type(self).__name__} prefills whole prompts, so max_num_batched_tokens "
                f"({max_num_batched_tokens}) must be >= max_model_len ({max_model_len}); "
                "raise it or use scheduler=chunked"
            )
        self.allocator = allocator
        self.preemption = preemption
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.admission = admission
        self.order = order
        self.waiting: list[SequenceGroup] = []  # sorted by queue_key
        self.running: list[SequenceGroup] = []
        self.swapped: list[SequenceGroup] = []
        self.reserved_blocks: dict[str, int] = {}  # reserve mode: request -> worst-case blocks
        self.num_preemptions = {"recompute": 0, "swap": 0}
        self.num_recomputed_tokens = 0
        self.dropped: list[SequenceGroup] = []  # finished by schedule() itself (cache full)
        # the running sequences while they all decode (see servelab.step.decode_batch);
        # None whenever a step must take the general path
        self.decode_batch: DecodeBatch | None = None

    # -- queues
    def add(self, group: SequenceGroup) -> None:
        if group.params.n > self.max_num_seqs:
            raise RequestError(
                f"request {group.request_id!r} asks for n={group.params.n} samples but "
                f"max_num_seqs={self.max_num_seqs} sequences can run at once"
            )
        if self.admission == "reserve":
            need = self.worst_case_blocks(group)
            if need > self.allocator.num_blocks:
                raise RequestError(
                    f"request {group.request_id!r} can never fit: prompt {group.seqs[0].num_prompt_tokens}"
                    f" + max_tokens {group.params.max_tokens} (capped at max_model_len "
                    f"{self.max_model_len}) x n={group.params.n} needs {need} KV blocks of "
                    f"{self.allocator.block_size} tokens, the cache has {self.allocator.num_blocks}"
                )
        bisect.insort(self.waiting, group, key=queue_key)

    def abort(self, request_id: str) -> list[Sequence]:
        self.decode_batch = None
        for queue in (self.waiting, self.running, self.swapped):
            for group in queue:
                if group.request_id == request_id:
                    queue.remove(group)
                    aborted = group.unfinished()
                    for seq in aborted:
                        self.finish(seq, FinishReason.ABORT)
                    self.release_group(group)
                    self.forget(request_id)
                    return aborted
        return []

    def forget(self, request_id: str) -> None:
        """Drops what a subclass keeps per request; called on abort (a hook)."""

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    @property
    def num_running_seqs(self) -> int:
        return sum(g.num_unfinished for g in self.running)

    # -- what a built-in changes
    def tokens_for(self, seq: Sequence, start: int, budget: int) -> int:
        """Tokens `seq` may run this step from `start`: here the whole rest or nothing."""
        rest = seq.num_tokens - start
        return rest if rest <= budget else 0

    def admit(self, plan: StepPlan, budget: int) -> int:
        """Admits waiting groups in queue order while limits allow; returns the budget left."""
        return self.admit_in_order(plan, budget)

    def order_key(self, group: SequenceGroup) -> tuple:
        """A waiting group's place in admission order (`order`): lower first."""
        if self.order == "lpm":
            cached = self.allocator.match_prefix(group.seqs[0])
            return (group.priority, -cached, group.arrival_time, group.seqs[0].seq_id)
        return queue_key(group)

    def admission_order(self) -> list[SequenceGroup]:
        """The waiting groups in `order_key` order (fcfs: the queue as it is)."""
        if self.order == "fcfs":
            return list(self.waiting)
        return sorted(self.waiting, key=self.order_key)

    def admit_in_order(self, plan: StepPlan, budget: int, max_groups: int | None = None) -> int:
        """Admits waiting groups in `order_key` order until one does not fit (no
        overtaking) or `max_groups` were admitted."""
        return self.admit_each(self.admission_order(), plan, budget, max_groups)

    def admit_each(
        self,
        groups: list[SequenceGroup],
        plan: StepPlan,
        budget: int,
        max_groups: int | None = None,
    ) -> int:
        """Admits `groups` (waiting ones) in the order given until one does not fit."""
        for admitted, group in enumerate(groups):
            if max_groups is not None and admitted >= max_groups:
                break
            used = self.admit_one(group, plan, budget)
            if used is None:
                break
            budget -= used
        return budget

    def admit_one(self, group: SequenceGroup, plan: StepPlan, budget: int) -> int | None:
        """`try_admit`, then the group leaves the waiting queue; None when it does not fit."""
        used = self.try_admit(group, plan, budget)
        if used is not None and group in self.waiting:  # try_admit removes one it drops
            self.waiting.remove(group)
        return used

    # -- one step
    def schedule(self) -> StepPlan:
        if self.decode_batch is not None and not self.swapped:
            plan = self.schedule_decode_batch(self.decode_batch)
            if plan is not None:
                if self.waiting:
                    self.admit(plan, self.max_num_batched_tokens - plan.num_batch_decodes)
                    plan.sort_decodes_first()
                plan.copies = self.allocator.take_copies()
                return plan
        self.decode_batch = None  # the general path may change anything the batch mirrors
        plan = StepPlan()
        budget = self.schedule_running(plan, self.max_num_batched_tokens)
        if not plan.preempted:
            self.resume_swapped(plan, budget)
            budget = self.max_num_batched_tokens - plan.num_tokens
        if not self.swapped:
            self.admit(plan, budget)
        plan.sort_decodes_first()
        plan.copies = self.allocator.take_copies()
        return plan

    def schedule_decode_batch(self, batch: DecodeBatch) -> StepPlan | None:
        """Every running sequence decodes one token: the running phase of
        `schedule` in array operations. None when a row needs what only the
        general path does (a preemption for want of blocks, a copy-on-write)."""
        rows = batch.rows_needing_block().tolist()
        blocks = self.allocator.extend_decodes(batch.seqs, rows)
        if blocks is None:
            return None
        batch.add_blocks(rows, blocks)
        return StepPlan(decodes=batch, decode_starts=batch.starts.copy())

    def schedule_running(self, plan: StepPlan, budget: int) -> int:
        # decodes first, then unfinished prefills; each part best-first
        queue = sorted(self.running, key=lambda g: (not self.is_decoding(g), queue_key(g)))
        kept: list[SequenceGroup] = []
        while queue:
            group = queue.pop(0)
            seqs = group.unfinished()
            if not seqs:  # static batching: a finished member holding its slot
                kept.append(group)
                continue
            counts = [self.tokens_for(s, s.num_computed_tokens, budget // len(seqs)) for s in seqs]
            if sum(counts) == 0:
                kept.append(group)
                continue
            while not self.can_allocate_all(seqs, counts):
                candidates = [g.unfinished() for g in queue if not g.is_finished] + [seqs]
                victim = self.preemption.select_victim(candidates)
                victim_group = victim[0].group
                if victim_group is group and not queue and all(g.is_finished for g in kept):
                    # alone in the cache and still no room: it can never finish
                    for seq in seqs:
                        self.finish(seq, FinishReason.CACHE_FULL)
                    self.release_group(group)
                    self.dropped.append(group)
                    break
                self.preempt(victim_group, plan)
                if victim_group is group:
                    break
                queue.remove(victim_group)
            else:
                self.allocate_and_plan(seqs, counts, plan)
                budget -= sum(counts)
                kept.append(group)
        self.running = kept
        return budget

    def resume_swapped(self, plan: StepPlan, budget: int) -> None:
        self.swapped.sort(key=queue_key)
        while self.swapped:
            used = self.resume_one(self.swapped[0], plan, budget)
            if used is None:
                return
            budget -= used

    def resume_one(self, group: SequenceGroup, plan: StepPlan, budget: int) -> int | None:
        """Brings one swapped group back and plans its tokens; None when it cannot."""
        seqs = group.unfinished()
        if self.num_running_seqs + len(seqs) > self.max_num_seqs or budget < len(seqs):
            return None
        if not self.preemption.resume(seqs, self.allocator):
            return None
        self.swapped.remove(group)
        for seq in seqs:
            seq.status = SequenceStatus.RUNNING
        self.running.append(group)
        counts = [self.tokens_for(s, s.num_computed_tokens, budget // len(seqs)) for s in seqs]
        if sum(counts) and self.can_allocate_all(seqs, counts):
            self.allocate_and_plan(seqs, counts, plan)
            return sum(counts)
        return 0

    def try_admit(self, group: SequenceGroup, plan: StepPlan, budget: int) -> int | None:
        """Admits one waiting group if limits allow; returns tokens scheduled, None if not."""
        seqs = group.unfinished()
        batch = self.decode_batch  # its rows are running: a cheap first check
        if batch is not None and len(batch) + len(seqs) > self.max_num_seqs:
            return None
        if self.num_running_seqs + len(seqs) > self.max_num_seqs:
            return None
        if self.admission == "reserve":
            need = self.worst_case_blocks(group)
            if sum(self.reserved_blocks.values()) + need > self.allocator.num_blocks:
                return None
        starts = [max(s.num_computed_tokens, self.allocator.match_prefix(s)) for s in seqs]
        if plan.is_empty:
            # first in the step: a recomputing group of n samples may exceed the
            # budget on its own, and would otherwise never be admitted
            budget = max(budget, sum(s.num_tokens - st for s, st in zip(seqs, starts)))
        counts = []
        for seq, start in zip(seqs, starts):
            counts.append(self.tokens_for(seq, start, budget - sum(counts)))
        if 0 in counts:
            return None
        if not self.allocate_fresh(seqs, [s + c for s, c in zip(starts, counts)]):
            if self.allocator.num_free_blocks == self.allocator.num_blocks:
                for seq in seqs:  # an empty cache cannot hold it: it can never run
                    self.finish(seq, FinishReason.CACHE_FULL)
                self.waiting.remove(group)
                self.release_group(group)
                self.dropped.append(group)
                return 0
            return None
        if self.admission == "reserve":
            self.reserved_blocks[group.request_id] = self.worst_case_blocks(group)
        for seq, count in zip(seqs, counts):
            seq.status = SequenceStatus.RUNNING
            plan.items.append(ScheduledSeq(seq, count))
        self.running.append(group)
        return sum(counts)

    def allocate_fresh(self, seqs: list[Sequence], targets: list[int]) -> bool:
        """Allocates sequences that hold no blocks yet (all or none)."""
        done = []
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

    # -- helpers
    @staticmethod
    def is_decoding(group: SequenceGroup) -> bool:
        return all(s.num_uncomputed_tokens == 1 for s in group.unfinished())

    def worst_case_blocks(self, group: SequenceGroup) -> int:
        seq = group.seqs[0]
        tokens = min(seq.num_prompt_tokens + group.params.max_tokens, self.max_model_len)
        return group.params.n * cdiv(tokens, self.allocator.block_size)

    def can_allocate_all(self, seqs: list[Sequence], counts: list[int]) -> bool:
        """Room for every sequence's tokens this step, counted together."""
        pairs = [(s, s.num_computed_tokens + c) for s, c in zip(seqs, counts) if c]
        return self.allocator.blocks_needed_together(pairs) <= self.allocator.num_free_blocks

    def allocate_and_plan(self, seqs: list[Sequence], counts: list[int], plan: StepPlan) -> None:
        for seq, count in zip(seqs, counts):
            if count:
                self.allocator.allocate(seq, seq.num_computed_tokens + count)
                plan.items.append(ScheduledSeq(seq, count))

    def preempt(self, group: SequenceGroup, plan: StepPlan) -> None:
        self.decode_batch = None
        seqs = group.unfinished()
        kind = self.preemption.preempt(seqs, self.allocator)
        self.release_reservation(group)
        for seq in seqs:
            seq.num_preemptions += 1
        if kind == "swapped":
            self.num_preemptions["swap"] += 1
            for seq in seqs:
                seq.status = SequenceStatus.SWAPPED
            self.swapped.append(group)
        else:
            self.num_preemptions["recompute"] += 1
            for seq in seqs:
                seq.status = SequenceStatus.WAITING
                self.num_recomputed_tokens += seq.num_computed_tokens
                seq.num_recomputed_tokens += seq.num_computed_tokens
                seq.num_computed_tokens = 0
            bisect.insort(self.waiting, group, key=queue_key)
        plan.preempted.extend(seqs)

    def release_reservation(self, group: SequenceGroup) -> None:
        self.reserved_blocks.pop(group.request_id, None)

    def release_group(self, group: SequenceGroup) -> None:
        """Frees what a group that left the queues still holds."""
        self.release_reservation(group)
        for seq in group.seqs:
            self.allocator.free(seq)

    # -- checks
    def check_integrity(self) -> None:
        """Asserts the decode batch, when there is one, mirrors the running
        sequences exactly (tests call this after every step)."""
        batch = self.decode_batch
        if batch is None:
            return
        batch.check(self.allocator.block_table)
        running = [s.seq_id for g in self.running for s in g.seqs if not s.is_finished]
        assert sorted(running) == sorted(batch.seq_ids), "decode batch differs from running"

    # -- figures
    def stats(self) -> dict[str, float]:
        # after a step the decode batch, when there is one, is exactly the running
        # sequences (check_decode_batch): its length saves a walk over every group
        batch = self.decode_batch
        return {
            "waiting": len(self.waiting),
            "running": len(batch) if batch is not None else self.num_running_seqs,
            "swapped": len(self.swapped),
            "preemptions_recompute": self.num_preemptions["recompute"],
            "preemptions_swap": self.num_preemptions["swap"],
            "recomputed_tokens": self.num_recomputed_tokens,
        }
