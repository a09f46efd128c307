"""`SchedulerCore`: the part of every scheduler that owns correctness.

Queues hold `SequenceGroup`s (a request and, after its prompt, its n samples).
`schedule()` runs three phases (running, swapped, waiting); a policy
(`servelab.contracts.scheduler.SchedulingPolicy`) answers the questions it asks: who to admit and
in what order, how many tokens a sequence runs, whom to preempt. Admission,
block accounting, the decode batch, preemption and finishing stay here, and
every answer is checked before it is acted on.

Admission modes: `reserve` admits a group only when its worst case (prompt + max_tokens for
each of its n samples) fits next to every admitted group's, so it never preempts; `on_demand`
needs room for what runs now, and when blocks run out the preemption policy frees a victim.
Base order (`order`): `fcfs` by (priority, arrival); `lpm` by (priority, longest prefix the
allocator already caches, arrival), SGLang's cache-aware order.
"""

from __future__ import annotations

import bisect

from servelab.contracts.allocator import KVAllocator
from servelab.contracts.preemption import PreemptionPolicy
from servelab.contracts.scheduler import (
    SchedulingPolicy,
    SchedulingPolicyError,
    prefills_whole_prompts,
)
from servelab.errors import ConfigError, RequestError
from servelab.scheduling.prefilled import PendingPrefilled, PrefilledAdmission
from servelab.scheduling.transitions import QueueTransitions, queue_key
from servelab.step.decode_batch import DecodeBatch
from servelab.step.plan import ScheduledSeq, StepPlan
from servelab.step.sequence import FinishReason, Sequence, SequenceGroup, SequenceStatus


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class SchedulerCore(QueueTransitions, PrefilledAdmission):
    """The engine's scheduler: queues, the running and swapped phases and
    preemption (`schedule`); from `QueueTransitions`, admission and what happens
    after the forward (`update`). It asks `policy` its questions (the hooks of
    `servelab.contracts.scheduler.SchedulingPolicy`) and checks every answer."""

    # steady decode phases run as a DecodeBatch (same plans, array bookkeeping);
    # False makes every step take the general path (tests compare the two)
    decode_fast_path = True

    def __init__(
        self,
        policy: SchedulingPolicy,
        allocator: KVAllocator,
        preemption: PreemptionPolicy,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
    ) -> None:
        name = type(policy).__name__
        if prefills_whole_prompts(type(policy)) and max_num_batched_tokens < max_model_len:
            raise ConfigError(
                f"{name} prefills whole prompts, so max_num_batched_tokens "
                f"({max_num_batched_tokens}) must be >= max_model_len ({max_model_len}); "
                "raise it or use scheduler=chunked"
            )
        self.policy = policy
        policy.core = self
        self.admission = policy.admission
        self.order = policy.order
        self.allocator = allocator
        self.preemption = preemption
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: list[SequenceGroup] = []  # sorted by queue_key
        self.running: list[SequenceGroup] = []
        self.swapped: list[SequenceGroup] = []
        self.reserved_blocks: dict[str, int] = {}  # reserve mode: request -> worst-case blocks
        self.num_preemptions = {"recompute": 0, "swap": 0}
        self.num_recomputed_tokens = 0
        self.step_count = 0  # schedule() calls so far
        self.cache_full: list[SequenceGroup] = []  # finished by schedule() itself (cache full)
        # the running sequences while they all decode (see servelab.step.decode_batch);
        # None whenever a step must take the general path
        self.decode_batch: DecodeBatch | None = None
        self._holds_slots = type(policy).keeps_slot is not SchedulingPolicy.keeps_slot
        # requests prefilled elsewhere, waiting for admission (`add_prefilled`)
        self.prefilled: list[PendingPrefilled] = []
        self.num_prefilled = {"admitted": 0, "recomputed": 0, "prefix_hit_tokens": 0}

    # -- the contract: queues
    def add(self, group: SequenceGroup) -> None:
        if group.params.n > self.max_num_seqs:
            raise RequestError(
                f"request {group.request_id!r} asks for n={group.params.n} samples but "
                f"max_num_seqs={self.max_num_seqs} sequences can run at once"
            )
        if self.admission == "reserve":
            need = self._worst_case_blocks(group)
            if need > self.allocator.num_blocks:
                raise RequestError(
                    f"request {group.request_id!r} can never fit: prompt {group.seqs[0].num_prompt_tokens}"
                    f" + max_tokens {group.params.max_tokens} (capped at max_model_len "
                    f"{self.max_model_len}) x n={group.params.n} needs {need} KV blocks of "
                    f"{self.allocator.block_size} tokens, the cache has {self.allocator.num_blocks}"
                )
        bisect.insort(self.waiting, group, key=queue_key)
        self.policy.on_add(group)

    def abort(self, request_id: str) -> list[Sequence]:
        self.decode_batch = None
        if self.prefilled and (aborted := self._abort_prefilled(request_id)) is not None:
            return aborted
        for queue in (self.waiting, self.running, self.swapped):
            for group in queue:
                if group.request_id == request_id:
                    queue.remove(group)
                    aborted = group.unfinished()
                    for seq in aborted:
                        self._finish(seq, FinishReason.ABORT)
                    self._release_group(group)
                    self.policy.on_request_end(group)
                    return aborted
        return []

    def stop(self, seq: Sequence) -> None:
        """Finishes `seq` from outside the step (a stop string matched its text)."""
        self.decode_batch = None  # it may hold the row; rebuilt next step
        self._finish(seq, FinishReason.STOP)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped or self.prefilled)

    @property
    def num_running_seqs(self) -> int:
        return sum(g.num_unfinished for g in self.running)

    def order_key(self, group: SequenceGroup) -> tuple:
        """A group's place in the base order (`order`): lower first."""
        if self.order == "lpm":
            cached = self.allocator.match_prefix(group.seqs[0])
            return (group.priority, -cached, group.arrival_time, group.seqs[0].seq_id)
        return queue_key(group)

    # -- the contract: one step
    def schedule(self) -> StepPlan:
        self.step_count += 1
        if self.prefilled:  # handed-over requests (disaggregation) waiting to be admitted
            self._admit_prefilled()
        victims = self.policy.pick_victims()
        plan = self._preempt_victims(victims) if victims else None
        if plan is None and self.decode_batch is not None and not self.swapped:
            plan = self._schedule_decode_batch(self.decode_batch)
            if plan is not None:
                if self.waiting:
                    self._admit(plan, self.max_num_batched_tokens - plan.num_batch_decodes)
                    plan.sort_decodes_first()
                return self._finish_plan(plan)
        self.decode_batch = None  # the general path may change anything the batch mirrors
        plan = plan or StepPlan()
        budget = self._schedule_running(plan, self.max_num_batched_tokens)
        self._admit(plan, budget)
        plan.sort_decodes_first()
        return self._finish_plan(plan)

    def _finish_plan(self, plan: StepPlan) -> StepPlan:
        plan.copies = self.allocator.take_copies()
        if self._holds_slots:  # finished sequences of groups that keep their slots
            plan.idle_slots = sum(
                1
                for queue in (self.running, self.waiting, self.swapped)
                for g in queue
                if self.policy.keeps_slot(g)
                for s in g.seqs
                if s.is_finished
            )
        return plan

    def _preempt_victims(self, victims: list[SequenceGroup]) -> StepPlan:
        plan = StepPlan()
        self.decode_batch = None
        for group in victims:
            if group not in self.running or group.is_finished:
                raise SchedulingPolicyError(
                    f"{type(self.policy).__name__}.pick_victims chose request {group.request_id!r}, "
                    "which is not a running, unfinished group (or was chosen twice)"
                )
            self.running.remove(group)
            self._preempt(group, plan)
        return plan

    # -- the running and swapped phases
    def _schedule_decode_batch(self, batch: DecodeBatch) -> StepPlan | None:
        """Every running sequence decodes one token: the running phase in array
        operations. None when a row needs what only the general path does."""
        rows = batch.rows_needing_block().tolist()
        blocks = self.allocator.extend_decodes(batch.seqs, rows)
        if blocks is None:
            return None
        batch.add_blocks(rows, blocks)
        return StepPlan(decodes=batch, decode_starts=batch.starts.copy())

    def _schedule_running(self, plan: StepPlan, budget: int) -> int:
        # decodes first, then unfinished prefills; each part best-first
        queue = sorted(self.running, key=lambda g: (not _is_decoding(g), queue_key(g)))
        kept: list[SequenceGroup] = []
        while queue:
            group = queue.pop(0)
            seqs = group.unfinished()
            if not seqs:  # a finished group keeping its slot
                kept.append(group)
                continue
            counts = [self._tokens(s, s.num_computed_tokens, budget // len(seqs)) for s in seqs]
            if sum(counts) == 0:
                kept.append(group)
                continue
            while not self._can_allocate_all(seqs, counts):
                candidates = [g.unfinished() for g in queue if not g.is_finished] + [seqs]
                victim_group = self.preemption.select_victim(candidates)[0].group
                assert victim_group is not None  # a queued sequence belongs to its group
                if victim_group is group and not queue and all(g.is_finished for g in kept):
                    # alone in the cache and still no room: it can never finish
                    for seq in seqs:
                        self._finish(seq, FinishReason.CACHE_FULL)
                    self._release_group(group)
                    self.cache_full.append(group)
                    break
                self._preempt(victim_group, plan)
                if victim_group is group:
                    break
                queue.remove(victim_group)
            else:
                for seq, count in zip(seqs, counts):
                    if count:
                        self.allocator.allocate(seq, seq.num_computed_tokens + count)
                        plan.items.append(ScheduledSeq(seq, count))
                budget -= sum(counts)
                kept.append(group)
        self.running = kept
        return budget

    def _resume_one(self, group: SequenceGroup, plan: StepPlan, budget: int) -> int | None:
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
        counts = [self._tokens(s, s.num_computed_tokens, budget // len(seqs)) for s in seqs]
        if sum(counts) and self._can_allocate_all(seqs, counts):
            for seq, count in zip(seqs, counts):
                if count:
                    self.allocator.allocate(seq, seq.num_computed_tokens + count)
                    plan.items.append(ScheduledSeq(seq, count))
            return sum(counts)
        return 0

    def _can_allocate_all(self, seqs: list[Sequence], counts: list[int]) -> bool:
        """Room for every sequence's tokens this step, counted together."""
        pairs = [(s, s.num_computed_tokens + c) for s, c in zip(seqs, counts) if c]
        return self.allocator.blocks_needed_together(pairs) <= self.allocator.num_free_blocks

    def _preempt(self, group: SequenceGroup, plan: StepPlan) -> None:
        self.decode_batch = None
        seqs = group.unfinished()
        kind = self.preemption.preempt(seqs, self.allocator)
        self.reserved_blocks.pop(group.request_id, None)
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

    def _release_group(self, group: SequenceGroup) -> None:
        """Frees what a group that left the queues still holds."""
        self.reserved_blocks.pop(group.request_id, None)
        for seq in group.seqs:
            self.allocator.free(seq)

    def _worst_case_blocks(self, group: SequenceGroup) -> int:
        seq = group.seqs[0]
        tokens = min(seq.num_prompt_tokens + group.params.max_tokens, self.max_model_len)
        return group.params.n * cdiv(tokens, self.allocator.block_size)

    # -- checks and figures
    def check_integrity(self) -> None:
        """Asserts the decode batch, when there is one, mirrors the running
        sequences exactly (tests call this after every step)."""
        batch = self.decode_batch
        if batch is None:
            return
        batch.check(self.allocator.block_table)
        running = [s.seq_id for g in self.running for s in g.seqs if not s.is_finished]
        assert sorted(running) == sorted(batch.seq_ids), "decode batch differs from running"

    def stats(self) -> dict[str, float]:
        # after a step the decode batch, when there is one, is exactly the running
        # sequences: its length saves a walk over every group
        batch = self.decode_batch
        return {
            "waiting": len(self.waiting),
            "running": len(batch) if batch is not None else self.num_running_seqs,
            "swapped": len(self.swapped),
            "preemptions_recompute": self.num_preemptions["recompute"],
            "preemptions_swap": self.num_preemptions["swap"],
            "recomputed_tokens": self.num_recomputed_tokens,
            # a decode instance's figures (disaggregation): none until one arrived
            **(
                self._prefilled_stats()
                if self.prefilled or any(self.num_prefilled.values())
                else {}
            ),  # fmt: skip
            **self.policy.policy_stats(),
        }


def _is_decoding(group: SequenceGroup) -> bool:
    return all(s.num_uncomputed_tokens == 1 for s in group.unfinished())
