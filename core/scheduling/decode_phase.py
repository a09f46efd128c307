"""`DecodePhase`: the scheduler's steady decode phase as a `DecodeBatch`.

While every running sequence decodes, the running phase and the update run as
array operations on the batch (`servelab.step.decode_batch`) instead of Python
work per sequence; the plans are the same. The batch is built after a step
that leaves every running sequence decoding, grown as prefills complete,
shrunk as rows finish, and dropped on anything else (preemption, fork, abort,
swap, a stop string): the next step then takes the general path.
"""

from __future__ import annotations

import numpy as np

from servelab.contracts.allocator import KVAllocator
from servelab.scheduling.admission import Queues, stop_if_done
from servelab.step.decode_batch import DecodeBatch
from servelab.step.plan import SampledTokens, StepPlan
from servelab.step.sequence import SequenceGroup


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
        self.enabled = True  # False: every step takes the general path (tests compare the two)
        self.batch: DecodeBatch | None = None  # the running sequences while they all decode

    def drop(self) -> None:
        self.batch = None

    def schedule(self) -> StepPlan | None:
        """Every running sequence decodes one token: the running phase in array
        operations. None when there is no batch or a row needs what only the
        general path does."""
        batch = self.batch
        if batch is None:
            return None
        rows = batch.rows_needing_block().tolist()
        blocks = self.allocator.extend_decodes(batch.seqs, rows)
        if blocks is None:
            self.batch = None
            return None
        batch.add_blocks(rows, blocks)
        return StepPlan(decodes=batch, decode_starts=batch.starts.copy())

    def update(
        self, plan: StepPlan, sampled: SampledTokens, now: float, stopped: set[SequenceGroup]
    ) -> None:
        """`update` for the plan's decode-batch rows: their tokens come first in
        `sampled`, one per row."""
        batch = plan.decodes
        rows = plan.num_batch_decodes
        tokens = sampled.tokens[:rows]
        written, filled = batch.written_blocks(plan.decode_starts)
        candidates = batch.advance(tokens, now)
        if self.allocator.commit_decodes(batch.seqs, written, filled):
            self.batch = None  # its copies of the block tables are stale: rebuilt next step
        ending = [
            row
            for row, seq in candidates
            if stop_if_done(seq, self.max_model_len, self.allocator, stopped)
        ]
        if ending:
            keep = np.ones(len(batch), dtype=bool)
            keep[ending] = False
            batch.keep(keep)

    def refresh(self, plan: StepPlan, forked: bool) -> None:
        """After a step: keeps, grows or builds the batch when every running
        sequence now decodes (and one does), and drops it otherwise."""
        if forked or self.queues.swapped or not self.enabled:
            self.batch = None
            return
        batch = self.batch if plan.decodes is not None else None
        joining = []
        for item in plan.items:
            seq = item.seq
            if seq.is_finished:
                continue
            if not item.samples:  # a prompt still prefilling: not a decode yet
                self.batch = None
                return
            joining.append(seq)
        if batch is None:
            # after a general step: the plan must have covered every running sequence
            if (
                not joining
                or self.queues.num_running_seqs != len(joining)
                or len(joining) > self.max_num_batched_tokens
            ):
                self.batch = None
                return
            self.batch = DecodeBatch(
                joining,
                [self.allocator.block_table(s) for s in joining],
                self.allocator.block_size,
                self.max_model_len,
            )
        elif joining:
            if len(batch) + len(joining) > self.max_num_batched_tokens:
                self.batch = None
                return
            batch.append(joining, [self.allocator.block_table(s) for s in joining])
        if self.batch is not None and len(self.batch) == 0:
            self.batch = None  # nothing decodes: the next step admits on the general path

    def check(self) -> None:
        """Asserts the batch, when there is one, mirrors the running sequences exactly."""
        batch = self.batch
        if batch is None:
            return
        batch.check(self.allocator.block_table)
        running = [s.seq_id for g in self.queues.running for s in g.seqs if not s.is_finished]
        assert sorted(running) == sorted(batch.seq_ids), "decode batch differs from running"
