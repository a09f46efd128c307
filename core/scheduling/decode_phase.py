"""`DecodePhase`: the scheduler's steady decode phase, planned as `RunningRows`.

While every running sequence decodes, the running phase plans them all at once
from arrays kept between steps (`servelab.step.running_rows`) instead of one
sequence at a time; the plan and its update are the same either way. The rows
are built after a step that leaves every running sequence decoding, grown as
prefills complete, shrunk as rows finish, and dropped on anything else
(preemption, fork, abort, swap, a stop string): the next step then plans one
group at a time.
"""

from __future__ import annotations

import numpy as np

from servelab.contracts.allocator import KVAllocator
from servelab.scheduling.admission import Queues
from servelab.step.plan import StepPlan
from servelab.step.running_rows import RunningRows


class DecodePhase:
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
        needing = rows.rows_needing_block().tolist()
        blocks = self.allocator.extend_decodes(rows.seqs, needing)
        if blocks is None:
            self.rows = None
            return None
        rows.add_blocks(needing, blocks)
        plan = StepPlan()
        plan.add_rows(rows)
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
