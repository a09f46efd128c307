"""`Queues`, where each request of a scheduler is (waiting, running, swapped),
with the one seat check; and `Admission`, how a request starts running,
whichever way it came in.

The waiting phase of `schedule`: the policy's `admission_order` names the
groups to try, in order; each is checked (a candidate now, not seen before in
this step) and admitted, or resumed when swapped, only when the seats
(`max_num_seqs`), the reserve budget and the allocator allow, all blocks or
none. A group whose prompt cannot fit even an empty cache finishes as
"cache_full".

A request prefilled elsewhere (prefill/decode disaggregation) arrives as its
prompt and first sampled token, and on the real path the prompt's K/V. It
waits in `prefilled` until the start of a `schedule()` where the same checks
let it in (prefix-cache hits included); its `write_kv(seq, start)` then fills
the slots from `start` (the tokens the prefix cache did not already hold) to
the prompt's end, and it runs as a decoding sequence. One that does not fit
waits (`transfer="wait"`, first come first served) or becomes an ordinary
waiting request that recomputes prompt + first token (`transfer="recompute"`).

Admission modes (the policy's `admission` option): `reserve` admits a group only
when its worst case (prompt + max_tokens for each of its n samples) fits next to
every admitted group's, so it never preempts; `on_demand` needs room for what
runs now. Base order (`order`): see `servelab.contracts.scheduler`.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from servelab.contracts.allocator import KVAllocator
from servelab.contracts.scheduler import SchedulingPolicy, SchedulingPolicyError
from servelab.errors import RequestError
from servelab.step.plan import StepPlan
from servelab.step.sequence import FinishReason, Sequence, SequenceGroup, SequenceStatus

TRANSFER_MODES = ("wait", "recompute")
# writes a prefilled sequence's received K/V for its tokens [start, prompt end) into its blocks
KVWriter = Callable[[Sequence, int], None]
# resumes a swapped group and plans its tokens: tokens planned, or None when it cannot
Resume = Callable[[SequenceGroup, StepPlan, int], "int | None"]


def queue_key(group: SequenceGroup) -> tuple:
    """The waiting queue's order: priority, then arrival, then sequence id (a tie-break)."""
    return (group.priority, group.arrival_time, group.seqs[0].seq_id)


class Queues:
    """A group is in at most one queue: `waiting` (sorted by `queue_key`),
    `running` or `swapped`. `cache_full` collects the groups the scheduler
    finished itself in this step (their prompt cannot fit even an empty cache)."""

    def __init__(self, max_num_seqs: int) -> None:
        self.max_num_seqs = max_num_seqs
        self.waiting: list[SequenceGroup] = []
        self.running: list[SequenceGroup] = []
        self.swapped: list[SequenceGroup] = []
        self.cache_full: list[SequenceGroup] = []

    def queue(self, group: SequenceGroup) -> None:
        """Puts `group` in the waiting queue, in its place."""
        bisect.insort(self.waiting, group, key=queue_key)

    @property
    def num_running_seqs(self) -> int:
        return sum(g.num_unfinished for g in self.running)

    def has_seats(self, num_seqs: int) -> bool:
        """Whether `num_seqs` more sequences may run next to the running ones."""
        return self.num_running_seqs + num_seqs <= self.max_num_seqs

    def has_groups(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)


def stop_if_done(
    seq: Sequence, max_model_len: int, allocator: KVAllocator, stopped: set[SequenceGroup]
) -> bool:
    """Applies the stop rules after `seq`'s new token: a sequence that stops is
    finished, its blocks freed and its group added to `stopped`."""
    reason = seq.stop_reason(max_model_len)
    if reason is None:
        return False
    seq.finish(reason)
    allocator.free(seq)
    assert seq.group is not None  # a queued sequence belongs to its group
    stopped.add(seq.group)
    return True


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def checked_tokens(policy: SchedulingPolicy, seq: Sequence, start: int, budget: int) -> int:
    """The policy's `tokens_for`, refused unless it is a count the step can run."""
    count = policy.tokens_for(seq, start, budget)
    if not isinstance(count, int) or not 0 <= count <= min(seq.num_tokens - start, budget):
        raise SchedulingPolicyError(
            f"{type(policy).__name__}.tokens_for returned {count!r} for request "
            f"{seq.request_id!r}; it must be an integer from 0 to "
            f"min(tokens left {seq.num_tokens - start}, budget {budget})"
        )
    return count


@dataclass
class PendingPrefilled:
    group: SequenceGroup
    write_kv: KVWriter | None  # None: no K/V content (a simulated executor)
    transfer: str


class Admission:
    """The seats, the reserve budget and the allocator's room, checked once for
    every way in; the reserve budget (`reserved_blocks`) and the prefilled
    requests waiting (`prefilled`) are its own."""

    def __init__(
        self,
        queues: Queues,
        allocator: KVAllocator,
        policy: SchedulingPolicy,
        max_model_len: int,
    ) -> None:
        self.queues = queues
        self.allocator = allocator
        self.policy = policy
        self.mode = policy.admission
        self.order = policy.order
        self.max_model_len = max_model_len
        self.reserved_blocks: dict[str, int] = {}  # reserve mode: request -> worst-case blocks
        self.prefilled: list[PendingPrefilled] = []
        self.num_prefilled = {"admitted": 0, "recomputed": 0, "prefix_hit_tokens": 0}
        # while `admit` runs with a known count of running sequences: that count, kept
        # current as groups start (None: the seat check counts them)
        self._running_seqs: int | None = None

    def order_key(self, group: SequenceGroup) -> tuple:
        """A group's place in the base order (`order`): lower first."""
        if self.order == "lpm":
            cached = self.allocator.match_prefix(group.seqs[0])
            return (group.priority, -cached, group.arrival_time, group.seqs[0].seq_id)
        return queue_key(group)

    # -- the checks, once for every way in
    def check_request(self, group: SequenceGroup) -> None:
        """Refuses (`RequestError`) a request that can never run, before it is queued."""
        if group.params.n > self.queues.max_num_seqs:
            raise RequestError(
                f"request {group.request_id!r} asks for n={group.params.n} samples but "
                f"max_num_seqs={self.queues.max_num_seqs} sequences can run at once"
            )
        if self.mode == "reserve":
            need = self.worst_case_blocks(group)
            if need > self.allocator.num_blocks:
                raise RequestError(
                    f"request {group.request_id!r} can never fit: prompt {group.seqs[0].num_prompt_tokens}"
                    f" + max_tokens {group.params.max_tokens} (capped at max_model_len "
                    f"{self.max_model_len}) x n={group.params.n} needs {need} KV blocks of "
                    f"{self.allocator.block_size} tokens, the cache has {self.allocator.num_blocks}"
                )

    def worst_case_blocks(self, group: SequenceGroup) -> int:
        seq = group.seqs[0]
        tokens = min(seq.num_prompt_tokens + group.params.max_tokens, self.max_model_len)
        return group.params.n * cdiv(tokens, self.allocator.block_size)

    def fits(self, group: SequenceGroup, num_seqs: int) -> bool:
        """Seats for `num_seqs` more sequences and, in reserve mode, room for the
        group's worst case next to every admitted group's."""
        if self._running_seqs is None:
            if not self.queues.has_seats(num_seqs):
                return False
        elif self._running_seqs + num_seqs > self.queues.max_num_seqs:
            return False
        if self.mode == "reserve":
            need = self.worst_case_blocks(group)
            return sum(self.reserved_blocks.values()) + need <= self.allocator.num_blocks
        return True

    def start_running(self, group: SequenceGroup, seqs: list[Sequence]) -> None:
        if self.mode == "reserve":
            self.reserved_blocks[group.request_id] = self.worst_case_blocks(group)
        for seq in seqs:
            seq.status = SequenceStatus.RUNNING
        self.queues.running.append(group)
        if self._running_seqs is not None:
            self._running_seqs += len(seqs)

    def release(self, group: SequenceGroup) -> None:
        """Frees what a group that left the queues still holds."""
        self.reserved_blocks.pop(group.request_id, None)
        for seq in group.seqs:
            self.allocator.free(seq)

    # -- the waiting phase
    def admit(
        self, plan: StepPlan, budget: int, resume: Resume, running_seqs: int | None = None
    ) -> None:
        """Admits (or `resume`s, when swapped) the policy's `admission_order` one
        group at a time until one does not fit. `running_seqs`: the running sequences
        when the caller knows them (the decode phase's rows), so that the seat check
        does not count them for every candidate."""
        self._running_seqs = running_seqs
        try:
            self._admit(plan, budget, resume)
        finally:
            self._running_seqs = None

    def _admit(self, plan: StepPlan, budget: int, resume: Resume) -> None:
        queues = self.queues
        # swapped groups first (by arrival), then the waiting ones in the base order;
        # a group swapped out in this step is no candidate
        queues.swapped.sort(key=queue_key)
        just_preempted = {s.group for s in plan.preempted} if plan.preempted else set()
        candidates = [g for g in queues.swapped if g not in just_preempted]
        if self.order == "fcfs":
            candidates += queues.waiting
        else:
            candidates += sorted(queues.waiting, key=self.order_key)
        order = self.policy.admission_order(list(candidates), plan)
        for group in self._checked(order, candidates):
            if group in queues.swapped:
                used = resume(group, plan, budget)
            else:
                used = self._admit_waiting(group, plan, budget)
            if used is None:
                break
            budget -= used
            if budget <= 0:  # spent (a first group of n recomputing samples may overspend it)
                break

    def _checked(
        self, order: Iterable[SequenceGroup], candidates: list[SequenceGroup]
    ) -> Iterable[SequenceGroup]:
        """The policy's order, refusing a group that was not a candidate or came twice.
        While it follows the candidates' own order (the default's), each is one by
        position; the set of the ones left is built only where it departs (a long
        waiting queue would otherwise be hashed every step, for the few admitted)."""
        allowed: set[SequenceGroup] | None = None
        for i, group in enumerate(order):
            if allowed is None:
                if i < len(candidates) and group is candidates[i]:
                    yield group
                    continue
                allowed = set(candidates[i:])  # the first i came in order, once each
            if group not in allowed:
                raise SchedulingPolicyError(
                    f"{type(self.policy).__name__}.admission_order returned request "
                    f"{group.request_id!r}, which is not a candidate to admit now (it is "
                    "already admitted, returned twice, or was never queued)"
                )
            allowed.discard(group)
            yield group

    def _admit_waiting(self, group: SequenceGroup, plan: StepPlan, budget: int) -> int | None:
        """Admits one waiting group if limits allow; returns tokens scheduled, None if not."""
        seqs = group.unfinished()
        if not self.fits(group, len(seqs)):
            return None
        starts = [max(s.num_computed_tokens, self.allocator.match_prefix(s)) for s in seqs]
        if plan.is_empty:
            # first in the step: a recomputing group of n samples may exceed the
            # budget on its own, and would otherwise never be admitted
            budget = max(budget, sum(s.num_tokens - st for s, st in zip(seqs, starts)))
        counts: list[int] = []
        for seq, start in zip(seqs, starts):
            counts.append(checked_tokens(self.policy, seq, start, budget - sum(counts)))
        if 0 in counts:
            return None
        if not self._allocate_fresh(seqs, [s + c for s, c in zip(starts, counts)]):
            if self.allocator.num_free_blocks == self.allocator.num_blocks:
                for seq in seqs:  # an empty cache cannot hold it: it can never run
                    seq.finish(FinishReason.CACHE_FULL)
                self.queues.waiting.remove(group)
                self.release(group)
                self.queues.cache_full.append(group)
                return 0
            return None
        self.queues.waiting.remove(group)
        self.start_running(group, seqs)
        for seq, count in zip(seqs, counts):
            plan.add(seq, count)
        return sum(counts)

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

    # -- requests prefilled elsewhere
    def add_prefilled(
        self, group: SequenceGroup, write_kv: KVWriter | None, transfer: str = "wait"
    ) -> None:
        """Queues a group of one sequence (prompt + its first sampled token, nothing
        computed yet) whose prompt K/V `write_kv` supplies on admission."""
        if transfer not in TRANSFER_MODES:
            raise RequestError(
                f"unknown transfer {transfer!r} for request {group.request_id!r}; "
                f"accepted: {', '.join(TRANSFER_MODES)}"
            )
        seq = group.seqs[0]
        if len(group.seqs) != 1 or group.params.n != 1:
            raise RequestError(
                f"request {group.request_id!r}: a prefilled request has one sample (n=1), "
                f"got n={group.params.n}"
            )
        if seq.num_output_tokens != 1 or seq.num_computed_tokens != 0:
            raise RequestError(
                f"request {group.request_id!r}: a prefilled request is its prompt and its "
                f"first token, nothing computed yet; got {seq.num_output_tokens} output "
                f"tokens, {seq.num_computed_tokens} computed"
            )
        self.check_request(group)
        self.prefilled.append(PendingPrefilled(group, write_kv, transfer))

    def admit_prefilled(self) -> bool:
        """At the start of a step: admits the prefilled requests that fit, in arrival
        order; one that does not fit waits (and the ones behind it) or recomputes.
        Whether any started running."""
        admitted = False
        while self.prefilled:
            pending = self.prefilled[0]
            if not self.queues.swapped and self._admit_prefilled(pending):
                self.prefilled.pop(0)
                admitted = True
                continue
            if pending.transfer == "wait":
                break
            self.prefilled.pop(0)
            self.num_prefilled["recomputed"] += 1
            # an ordinary request of prompt + first token: the prefill runs again here
            self.queues.queue(pending.group)
        return admitted

    def _admit_prefilled(self, pending: PendingPrefilled) -> bool:
        group = pending.group
        seq = group.seqs[0]
        prompt = seq.num_tokens - 1  # the first token's K/V is the first decode step's
        if not self.fits(group, 1) or not self._allocate_fresh([seq], [prompt]):
            return False
        if pending.write_kv is not None:
            # the start of a step: no copies are queued, so the fresh blocks are ours to fill
            pending.write_kv(seq, seq.num_cached_tokens)
        seq.num_computed_tokens = prompt
        self.allocator.commit(seq)  # full prompt blocks may now serve the prefix cache
        self.start_running(group, [seq])
        self.num_prefilled["admitted"] += 1
        self.num_prefilled["prefix_hit_tokens"] += seq.num_cached_tokens
        return True

    def abort_prefilled(self, request_id: str) -> SequenceGroup | None:
        """Takes a request still waiting for admission out; None when none is."""
        for pending in self.prefilled:
            if pending.group.request_id == request_id:
                self.prefilled.remove(pending)
                return pending.group
        return None

    def prefilled_stats(self) -> dict[str, float]:
        """Figures of a decode instance: none until a prefilled request arrived."""
        if not self.prefilled and not any(self.num_prefilled.values()):
            return {}
        return {
            "prefilled_waiting": len(self.prefilled),
            "prefilled_admitted": self.num_prefilled["admitted"],
            "prefilled_recomputed": self.num_prefilled["recomputed"],
            "prefilled_prefix_hit_tokens": self.num_prefilled["prefix_hit_tokens"],
        }
