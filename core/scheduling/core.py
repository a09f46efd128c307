"""`SchedulerCore`: the engine's scheduler, the part that owns correctness.

It composes small parts, each owning its state: `Queues` (waiting, running,
swapped; the seat check), `Admission` (the reserve budget, requests prefilled
elsewhere, and every way into running), `DecodePhase` (below: the steady
decode phase as arrays). Itself it runs a step: `schedule()` (preempt the policy's victims,
the running phase, then admission and resumption) and, after the forward,
`update()` (advance, append sampled tokens, fork, stop, free). A policy
(`servelab.contracts.scheduler.SchedulingPolicy`) answers the questions it asks
(who to admit, in what order, how many tokens a sequence runs, whom to
preempt), and every answer is checked before it is acted on.
"""

from __future__ import annotations

import numpy as np

from servelab.contracts.allocator import KVAllocator
from servelab.contracts.preemption import PreemptionPolicy
from servelab.contracts.scheduler import (
    SchedulingPolicy,
    SchedulingPolicyError,
    prefills_whole_prompts,
)
from servelab.errors import ConfigError
from servelab.scheduling.admission import (
    Admission,
    KVWriter,
    Queues,
    checked_tokens,
    queue_key,
    stop_if_done,
)
from servelab.scheduling.speculation import Speculation
from servelab.step.plan import RunningRows, SampledTokens, StepPlan
from servelab.step.sequence import FinishReason, Sequence, SequenceGroup, SequenceStatus


class DecodePhase:
    """The scheduler's steady decode phase, planned as `RunningRows`.

    While every running sequence decodes, the running phase plans them all at once
    from arrays kept between steps (`servelab.step.plan.RunningRows`) instead of one
    sequence at a time; the plan and its update are the same either way. The rows
    are built after a step that leaves every running sequence decoding, grown as
    prefills complete, shrunk as rows finish, and dropped on anything else
    (preemption, fork, abort, swap, a stop string): the next step then plans one
    group at a time."""

    def __init__(
        self,
        queues: Queues,
        allocator: KVAllocator,
        max_num_batched_tokens: int,
        max_model_len: int,
    ) -> None:
        self.queues = queues
        self.allocator = allocator
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enabled = True  # False: every step plans one group at a time (tests compare)
        self.rows: RunningRows | None = None  # the running sequences while they all decode

    def drop(self) -> None:
        self.rows = None

    def schedule(self) -> StepPlan | None:
        """Every running sequence decodes one token: the running phase in array
        operations. None when there are no rows or one needs what only planning
        one group at a time does (blocks are short, a write needs copy-on-write)."""
        rows = self.rows
        if rows is None:
            return None
        starts = rows.positions()
        needing = rows.rows_needing_block(starts).tolist()
        blocks = self.allocator.extend_decodes(rows.seqs, needing)
        if blocks is None:
            self.rows = None
            return None
        rows.add_blocks(needing, blocks)
        plan = StepPlan()
        plan.add_rows(rows, starts)
        return plan

    def update(self, plan: StepPlan, tokens: list[int], ending: list[int], rewritten: bool) -> None:
        """After a step whose decode rows were `tokens` (row order) and whose rows
        `ending` finished: advances the running rows (the plan's first ones) and
        lets the finished leave."""
        rows = self.rows
        if rows is None or plan.running_rows is not rows:
            return
        if rewritten:  # the allocator rewrote a block table: the rows' copies are stale
            self.rows = None
            return
        n = len(rows)
        rows.advanced(tokens[:n])
        ending = [r for r in ending if r < n]
        if ending:
            keep = np.ones(n, dtype=bool)
            keep[ending] = False
            rows.keep(keep)

    def refresh(self, plan: StepPlan, forked: bool) -> None:
        """After a step: keeps, grows or builds the rows when every running
        sequence now decodes (and one does), and drops them otherwise."""
        if forked or self.queues.swapped or not self.enabled:
            self.rows = None
            return
        rows = self.rows if self.rows is not None and plan.running_rows is self.rows else None
        joining = []
        for seq in plan.listed:
            if seq.is_finished:
                continue
            if not seq.is_decoding:  # a prompt still prefilling: not a decode yet
                self.rows = None
                return
            joining.append(seq)
        if rows is None:
            # after a step planned one group at a time: it must have covered every running sequence
            if (
                not joining
                or self.queues.num_running_seqs != len(joining)
                or len(joining) > self.max_num_batched_tokens
            ):
                self.rows = None
                return
            self.rows = RunningRows(
                joining,
                [self.allocator.block_table(s) for s in joining],
                self.allocator.block_size,
                self.max_model_len,
            )
        elif joining:
            if len(rows) + len(joining) > self.max_num_batched_tokens:
                self.rows = None
                return
            rows.append(joining, [self.allocator.block_table(s) for s in joining])
        if self.rows is not None and len(self.rows) == 0:
            self.rows = None  # nothing decodes: the next step admits one group at a time

    def check(self) -> None:
        """Asserts the rows, when there are some, mirror the running sequences exactly."""
        rows = self.rows
        if rows is None:
            return
        rows.check(self.allocator.block_table)
        running = [s.seq_id for g in self.queues.running for s in g.seqs if not s.is_finished]
        assert sorted(running) == sorted(rows.seq_ids), "decode rows differ from running"


class SchedulerCore:
    """What the engine calls (`add`, `add_prefilled`, `abort`, `stop`,
    `schedule`, `update`, `has_unfinished`, `stats`); what a policy reads
    (`waiting`, `running`, `swapped`, `num_running_seqs`, `allocator`,
    `max_num_seqs`, `step_count`, `order_key`)."""

    def __init__(
        self,
        policy: SchedulingPolicy,
        allocator: KVAllocator,
        preemption: PreemptionPolicy,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        speculation: Speculation | None = None,
    ) -> None:
        if prefills_whole_prompts(type(policy)) and max_num_batched_tokens < max_model_len:
            raise ConfigError(
                f"{type(policy).__name__} prefills whole prompts, so max_num_batched_tokens "
                f"({max_num_batched_tokens}) must be >= max_model_len ({max_model_len}); "
                "raise it or use scheduler=chunked"
            )
        self.policy = policy
        policy.core = self
        self.allocator = allocator
        self.preemption = preemption
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.queues = Queues(max_num_seqs)
        self.admission = Admission(self.queues, allocator, policy, max_model_len)
        self.decode_phase = DecodePhase(
            self.queues, allocator, max_num_batched_tokens, max_model_len
        )
        self.order_key = self.admission.order_key
        # speculative decoding (None or an inactive one: none). Its decode rows carry
        # drafts, so steps plan one group at a time (the decode phase's rows take one token)
        self.speculation = speculation if speculation is not None and speculation.active else None
        if self.speculation is not None:
            self.decode_phase.enabled = False
        self.num_preemptions = {"recompute": 0, "swap": 0}
        self.num_recomputed_tokens = 0
        self.step_count = 0  # schedule() calls so far
        self._holds_slots = type(policy).keeps_slot is not SchedulingPolicy.keeps_slot

    # -- what a policy reads
    @property
    def waiting(self) -> list[SequenceGroup]:
        return self.queues.waiting

    @property
    def running(self) -> list[SequenceGroup]:
        return self.queues.running

    @property
    def swapped(self) -> list[SequenceGroup]:
        return self.queues.swapped

    @property
    def num_running_seqs(self) -> int:
        return self.queues.num_running_seqs

    # -- requests in and out
    def add(self, group: SequenceGroup) -> None:
        self.admission.check_request(group)
        self.queues.queue(group)
        self.policy.on_add(group)

    def add_prefilled(
        self, group: SequenceGroup, write_kv: KVWriter | None, transfer: str = "wait"
    ) -> None:
        """Queues a request prefilled elsewhere (see `servelab.scheduling.admission`)."""
        self.admission.add_prefilled(group, write_kv, transfer)
        self.policy.on_add(group)

    def abort(self, request_id: str) -> list[Sequence]:
        self.decode_phase.drop()
        prefilled = self.admission.abort_prefilled(request_id) if self.admission.prefilled else None
        group = prefilled or self._take_queued(request_id)
        if group is None:
            return []
        aborted = group.unfinished()
        for seq in aborted:
            seq.finish(FinishReason.ABORT)
            self.allocator.free(seq)
        if prefilled is None:  # a prefilled request holds no blocks until it is admitted
            self.admission.release(group)
        self.policy.on_request_end(group)
        return aborted

    def _take_queued(self, request_id: str) -> SequenceGroup | None:
        for queue in (self.queues.waiting, self.queues.running, self.queues.swapped):
            for group in queue:
                if group.request_id == request_id:
                    queue.remove(group)
                    return group
        return None

    def stop(self, seq: Sequence) -> None:
        """Finishes `seq` from outside the step (a stop string matched its text)."""
        self.decode_phase.drop()  # the rows may hold it; rebuilt next step
        seq.finish(FinishReason.STOP)
        self.allocator.free(seq)

    def has_unfinished(self) -> bool:
        return self.queues.has_groups() or bool(self.admission.prefilled)

    # -- one step
    def schedule(self) -> StepPlan:
        self.step_count += 1
        if self.admission.prefilled and self.admission.admit_prefilled():
            self.decode_phase.drop()  # a new running sequence: the general path rebuilds it
        victims = self.policy.pick_victims()
        plan = self._preempt_victims(victims) if victims else None
        if plan is None and not self.queues.swapped:
            plan = self.decode_phase.schedule()
            if plan is not None:
                if self.queues.waiting:
                    rows = plan.running_rows
                    assert rows is not None  # the decode phase's plan takes them
                    # the rows are the running sequences (DecodePhase.check): no need to count
                    budget = self.max_num_batched_tokens - len(rows)
                    self.admission.admit(plan, budget, self._resume, running_seqs=len(rows))
                return self._finish_plan(plan)
        self.decode_phase.drop()  # planning a group at a time may change what the rows mirror
        plan = plan if plan is not None else StepPlan()
        budget = self._schedule_running(plan, self.max_num_batched_tokens)
        self.admission.admit(plan, budget, self._resume)
        return self._finish_plan(plan)

    def _finish_plan(self, plan: StepPlan) -> StepPlan:
        plan.wants_hidden = self.speculation is not None and self.speculation.wants_hidden
        plan.close(self.allocator.block_table, self.allocator.block_size, self.max_model_len)
        plan.copies = self.allocator.take_copies()
        if self._holds_slots:  # finished sequences of groups that keep their slots
            queues = self.queues
            plan.idle_slots = sum(
                1
                for queue in (queues.running, queues.waiting, queues.swapped)
                for g in queue
                if self.policy.keeps_slot(g)
                for s in g.seqs
                if s.is_finished
            )
        return plan

    def _preempt_victims(self, victims: list[SequenceGroup]) -> StepPlan:
        plan = StepPlan()
        for group in victims:
            if group not in self.queues.running or group.is_finished:
                raise SchedulingPolicyError(
                    f"{type(self.policy).__name__}.pick_victims chose request "
                    f"{group.request_id!r}, which is not a running, unfinished group "
                    "(or was chosen twice)"
                )
            self.queues.running.remove(group)
            self._preempt(group, plan)
        return plan

    def _schedule_running(self, plan: StepPlan, budget: int) -> int:
        # decodes first, then unfinished prefills; each part best-first
        queue = sorted(self.queues.running, key=lambda g: (not _is_decoding(g), queue_key(g)))
        if self.speculation is not None:
            self.speculation.draft([s for g in queue for s in g.unfinished() if s.is_decoding])
        kept: list[SequenceGroup] = []
        while queue:
            group = queue.pop(0)
            seqs = group.unfinished()
            if not seqs:  # a finished group keeping its slot
                kept.append(group)
                continue
            counts = self._counts(seqs, budget)
            if sum(counts) == 0:
                kept.append(group)
                continue
            while not self._can_allocate_all(seqs, counts):
                if self.speculation is not None and _drop_drafts(seqs, counts):
                    continue  # drafts are the first thing short memory goes without
                candidates = [g.unfinished() for g in queue if not g.is_finished] + [seqs]
                victim_group = self.preemption.select_victim(candidates)[0].group
                assert victim_group is not None  # a queued sequence belongs to its group
                if victim_group is group and not queue and all(g.is_finished for g in kept):
                    # alone in the cache and still no room: it can never finish
                    for seq in seqs:
                        seq.finish(FinishReason.CACHE_FULL)
                        self.allocator.free(seq)
                    self.admission.release(group)
                    self.queues.cache_full.append(group)
                    break
                self._preempt(victim_group, plan)
                if victim_group is group:
                    break
                queue.remove(victim_group)
            else:
                budget -= self._run(seqs, counts, plan)
                kept.append(group)
        self.queues.running[:] = kept
        return budget

    def _resume(self, group: SequenceGroup, plan: StepPlan, budget: int) -> int | None:
        """Brings one swapped group back and plans its tokens; None when it cannot."""
        seqs = group.unfinished()
        if budget < len(seqs) or not self.admission.fits(group, len(seqs)):
            return None
        if not self.preemption.resume(seqs, self.allocator):
            return None
        self.queues.swapped.remove(group)
        self.admission.start_running(group, seqs)
        counts = self._counts(seqs, budget)
        if sum(counts) and self._can_allocate_all(seqs, counts):
            return self._run(seqs, counts, plan)
        return 0

    def _counts(self, seqs: list[Sequence], budget: int) -> list[int]:
        """The policy's tokens for each running sequence, the budget shared evenly;
        a decode's drafts ride along within its share (and are cut to it)."""
        share = budget // len(seqs)
        counts = [checked_tokens(self.policy, s, s.num_computed_tokens, share) for s in seqs]
        if self.speculation is not None:
            for i, seq in enumerate(seqs):
                if seq.draft_tokens:
                    drafts = seq.draft_tokens[: share - counts[i]] if counts[i] else []
                    seq.draft_tokens = drafts
                    counts[i] += len(drafts)
        return counts

    def _can_allocate_all(self, seqs: list[Sequence], counts: list[int]) -> bool:
        """Room for every sequence's tokens this step, counted together."""
        pairs = [(s, s.num_computed_tokens + c) for s, c in zip(seqs, counts) if c]
        return self.allocator.blocks_needed_together(pairs) <= self.allocator.num_free_blocks

    def _run(self, seqs: list[Sequence], counts: list[int], plan: StepPlan) -> int:
        """Allocates and plans each sequence's tokens; returns how many."""
        for seq, count in zip(seqs, counts):
            if count:
                self.allocator.allocate(seq, seq.num_computed_tokens + count)
                plan.add(seq, count)
        return sum(counts)

    def _preempt(self, group: SequenceGroup, plan: StepPlan) -> None:
        self.decode_phase.drop()
        seqs = group.unfinished()
        kind = self.preemption.preempt(seqs, self.allocator)
        for seq in seqs:
            seq.draft_tokens = []
        self.admission.reserved_blocks.pop(group.request_id, None)
        for seq in seqs:
            seq.num_preemptions += 1
        if kind == "swapped":
            self.num_preemptions["swap"] += 1
            for seq in seqs:
                seq.status = SequenceStatus.SWAPPED
            self.queues.swapped.append(group)
        else:
            self.num_preemptions["recompute"] += 1
            for seq in seqs:
                seq.status = SequenceStatus.WAITING
                self.num_recomputed_tokens += seq.num_computed_tokens
                seq.num_recomputed_tokens += seq.num_computed_tokens
                seq.num_computed_tokens = 0
            self.queues.queue(group)
        plan.preempted.extend(seqs)

    # -- after the forward
    def update(self, plan: StepPlan, sampled: SampledTokens, now: float) -> list[SequenceGroup]:
        """Advances every scheduled sequence, appends sampled tokens (forking a
        group whose prompt just finished), applies stop rules and frees the
        finished (unless the policy's `keeps_slot` holds them); then the
        policy's `on_step_end` and `on_request_end`. Returns the groups that
        finished in this step."""
        queues = self.queues
        finished, queues.cache_full = queues.cache_full, []
        stopped: set[SequenceGroup] = set()  # groups with a sequence finished in this step
        num_decodes = plan.num_decodes
        if num_decodes:
            decoded = sampled.tokens  # the decode rows' tokens come first
            if len(decoded) != num_decodes:
                decoded = decoded[:num_decodes]
            ending, rewritten = self._update_decodes(plan, decoded, now, stopped)
            self.decode_phase.update(plan, decoded, ending, rewritten)
            if sampled.hidden is not None:
                for seq in plan.seqs[:num_decodes]:
                    self._deliver_hidden(seq, sampled, 1)
        forked = False
        drafts = plan.draft_counts
        for row, (seq, start, count, samples) in enumerate(plan.rows(num_decodes), num_decodes):
            if drafts is not None and drafts[row]:
                self._update_verified(seq, start, int(drafts[row]), sampled, now, stopped)
                continue
            if sampled.hidden is not None:
                self._deliver_hidden(seq, sampled, count)
            seq.num_computed_tokens += count
            self.allocator.commit(seq)
            # the decode rows' tokens come first: look only past them
            tokens = sampled.get(seq.seq_id, num_decodes) if samples else None
            if tokens is None:
                continue
            targets = [seq] + self._fork(seq, len(tokens) - 1)
            forked = forked or len(targets) > 1
            for target, token in zip(targets, tokens):
                target.append_token(token)
                target.token_times.append(now)
                stop_if_done(target, self.max_model_len, self.allocator, stopped)
        if stopped or self._holds_slots:
            for group in list(queues.running):  # in queue order
                if group.num_unfinished or (group not in stopped and not self._holds_slots):
                    continue
                if self._holds_slots and self.policy.keeps_slot(group):
                    continue
                queues.running.remove(group)
                self.admission.release(group)
                finished.append(group)
        self.decode_phase.refresh(plan, forked)
        self.policy.on_step_end(plan, finished)
        for group in finished:
            self.policy.on_request_end(group)
        return finished

    def _update_verified(
        self,
        seq: Sequence,
        start: int,
        drafted: int,
        sampled: SampledTokens,
        now: float,
        stopped: set[SequenceGroup],
    ) -> None:
        """`update` of a decode with drafts: it computed its last token and `drafted`
        drafts, and `sampled` holds what verification kept (the accepted drafts and
        the target's next token, `servelab.step.verify`). The tokens are appended up
        to a stop inside them; the K/V of the rest is released."""
        tokens = sampled.get(seq.seq_id) or []
        assert 1 <= len(tokens) <= drafted + 1, f"verification kept {len(tokens)} tokens"
        seq.draft_tokens = []
        appended = 0
        for token in tokens:
            seq.append_token(token)
            seq.token_times.append(now)
            appended += 1
            if seq.stop_reason(self.max_model_len) is not None:
                break
        # its last token and the drafts kept before the newest token have K/V
        seq.num_computed_tokens = start + appended
        self.allocator.truncate(seq, seq.num_computed_tokens)
        self.allocator.commit(seq)
        if sampled.hidden is not None:  # the kept positions' only
            self._deliver_hidden(seq, sampled, seq.num_computed_tokens - start)
        accepted = len(tokens) - 1
        seq.num_drafted_tokens += drafted
        seq.num_accepted_tokens += accepted
        seq.num_verifications += 1
        assert self.speculation is not None  # only a proposer gives a row drafts
        self.speculation.verified(seq, drafted, accepted)
        stop_if_done(seq, self.max_model_len, self.allocator, stopped)

    def _deliver_hidden(self, seq: Sequence, sampled: SampledTokens, count: int) -> None:
        """Hands the proposer the target's hidden states of `seq`'s first `count`
        positions computed this step."""
        assert self.speculation is not None and sampled.hidden is not None
        found = sampled.hidden.get(seq.seq_id)
        if found is not None:
            start, states = found
            self.speculation.tell_hidden_states(seq.seq_id, start, states[:count])

    def _update_decodes(
        self, plan: StepPlan, tokens: list[int], now: float, stopped: set[SequenceGroup]
    ) -> tuple[list[int], bool]:
        """`update` of the plan's decode rows, in array operations where it can:
        each computed one token and sampled the next (`tokens`, row order).
        Returns the rows that finished, and whether the allocator rewrote a
        block table."""
        n = len(tokens)
        seqs = plan.seqs if n == len(plan.seqs) else plan.seqs[:n]
        for seq, token in zip(seqs, tokens):
            seq.num_computed_tokens += 1
            seq.token_ids.append(token)
            seq.token_times.append(now)
        # the block each row wrote its token into, and the rows whose token filled it
        starts = plan.starts[:n]
        written = plan.decode_blocks.tolist()
        filled = (plan.decode_offsets == self.allocator.block_size - 1).nonzero()[0].tolist()
        rewritten = self.allocator.commit_decodes(seqs, written, filled)
        # candidates to stop: at their length now (num_tokens is start + 2), or a token
        # some row stops on (each applies its own rules in stop_if_done)
        candidates = (plan.stop_at[:n] - starts <= 2).nonzero()[0].tolist()
        if plan.stop_tokens:
            stops, at_length = plan.stop_tokens, set(candidates)
            candidates += [
                r for r, t in enumerate(tokens) if t in stops and r not in at_length
            ]
        ending = [
            r for r in candidates if stop_if_done(seqs[r], self.max_model_len, self.allocator, stopped)
        ]
        return ending, rewritten

    def _fork(self, parent: Sequence, count: int) -> list[Sequence]:
        if count:
            self.decode_phase.drop()
        group = parent.group
        assert group is not None  # a queued sequence belongs to its group
        children = []
        for _ in range(count):
            child = parent.fork(len(group.seqs), parent.params)
            child.group = group
            self.allocator.fork(parent, child)
            group.seqs.append(child)
            children.append(child)
        return children

    # -- checks and figures
    def check_integrity(self) -> None:
        """Asserts the decode phase's rows, when there are some, mirror the running
        sequences exactly (tests call this after every step)."""
        self.decode_phase.check()

    def stats(self) -> dict[str, float]:
        # after a step the decode phase's rows, when there are some, are exactly the
        # running sequences: their number saves a walk over every group
        rows = self.decode_phase.rows
        return {
            "waiting": len(self.queues.waiting),
            "running": len(rows) if rows is not None else self.num_running_seqs,
            "swapped": len(self.queues.swapped),
            "preemptions_recompute": self.num_preemptions["recompute"],
            "preemptions_swap": self.num_preemptions["swap"],
            "recomputed_tokens": self.num_recomputed_tokens,
            **self.admission.prefilled_stats(),
            **(self.speculation.stats() if self.speculation is not None else {}),
            **self.policy.policy_stats(),
        }


def _drop_drafts(seqs: list[Sequence], counts: list[int]) -> bool:
    """Plans `seqs` without their drafts; False when none had any."""
    dropped = False
    for i, seq in enumerate(seqs):
        if seq.draft_tokens:
            counts[i] -= len(seq.draft_tokens)
            seq.draft_tokens = []
            dropped = True
    return dropped


def _is_decoding(group: SequenceGroup) -> bool:
    return all(s.num_uncomputed_tokens == 1 for s in group.unfinished())
