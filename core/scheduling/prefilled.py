"""`PrefilledAdmission`: admitting a request whose prompt K/V was computed elsewhere.

Prefill/decode disaggregation hands a decode instance a request whose prompt another
instance prefilled: the prompt, the first sampled token, and (on the real path) the
prompt's K/V. Here it is a sequence of prompt + first token with `num_computed_tokens`
to be the prompt length, so only decoding remains. It waits in `prefilled` until the
scheduler core can admit it, at the start of a `schedule()`: `max_num_seqs`, the reserve
budget and the allocator (`blocks_needed` / `allocate`, prefix-cache hits included) must
allow the prompt's blocks. On admission the core calls the request's `write_kv(seq,
start)` to fill the slots from `start` (the tokens the prefix cache did not already hold)
to the prompt's end, then commits the blocks and runs it as a decoding sequence.
One that does not fit waits (`transfer="wait"`, first come first served) or becomes an
ordinary waiting request that recomputes prompt + first token (`transfer="recompute"`).
Part of `SchedulerCore`, kept in its own module; no torch here (the writer is the executor's).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass

from servelab.errors import RequestError
from servelab.scheduling.transitions import CoreState, queue_key
from servelab.step.sequence import FinishReason, Sequence, SequenceGroup, SequenceStatus

TRANSFER_MODES = ("wait", "recompute")
# writes a prefilled sequence's received K/V for its tokens [start, prompt end) into its blocks
KVWriter = Callable[[Sequence, int], None]


@dataclass
class PendingPrefilled:
    group: SequenceGroup
    write_kv: KVWriter | None  # None: no K/V content (a simulated executor)
    transfer: str


class PrefilledAdmission(CoreState):
    """`add_prefilled` and its admission; mixed into `SchedulerCore`."""

    prefilled: list[PendingPrefilled]
    num_prefilled: dict[str, int]
    _finish: Callable[[Sequence, FinishReason], None]

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
        if (
            self.admission == "reserve"
            and self._worst_case_blocks(group) > self.allocator.num_blocks
        ):
            raise RequestError(
                f"request {group.request_id!r} can never fit: its worst case needs "
                f"{self._worst_case_blocks(group)} KV blocks, the cache has {self.allocator.num_blocks}"
            )
        self.prefilled.append(PendingPrefilled(group, write_kv, transfer))
        self.policy.on_add(group)

    def _admit_prefilled(self) -> None:
        """At the start of a step: admits the prefilled requests that fit, in arrival
        order; one that does not fit waits (and the ones behind it) or recomputes."""
        while self.prefilled:
            pending = self.prefilled[0]
            if not self.swapped and self._admit_one_prefilled(pending):
                self.prefilled.pop(0)
                continue
            if pending.transfer == "wait":
                return
            self.prefilled.pop(0)
            self.num_prefilled["recomputed"] += 1
            # an ordinary request of prompt + first token: the prefill runs again here
            bisect.insort(self.waiting, pending.group, key=queue_key)

    def _admit_one_prefilled(self, pending: PendingPrefilled) -> bool:
        group = pending.group
        seq = group.seqs[0]
        prompt = seq.num_tokens - 1  # the first token's K/V is the first decode step's
        if self.num_running_seqs + 1 > self.max_num_seqs:
            return False
        if self.admission == "reserve":
            need = self._worst_case_blocks(group)
            if sum(self.reserved_blocks.values()) + need > self.allocator.num_blocks:
                return False
        if self.allocator.blocks_needed(seq, prompt) > self.allocator.num_free_blocks:
            return False
        cached = self.allocator.allocate(seq, prompt)
        seq.num_cached_tokens = cached
        if pending.write_kv is not None:
            # the start of a step: no copies are queued, so the fresh blocks are ours to fill
            pending.write_kv(seq, cached)
        seq.num_computed_tokens = prompt
        self.allocator.commit(seq)  # full prompt blocks may now serve the prefix cache
        if self.admission == "reserve":
            self.reserved_blocks[group.request_id] = self._worst_case_blocks(group)
        seq.status = SequenceStatus.RUNNING
        self.decode_batch = None  # a new running sequence: the general path rebuilds it
        self.running.append(group)
        self.num_prefilled["admitted"] += 1
        self.num_prefilled["prefix_hit_tokens"] += cached
        return True

    def _abort_prefilled(self, request_id: str) -> list[Sequence] | None:
        """Aborts a request still waiting for admission; None when none is."""
        for pending in self.prefilled:
            group = pending.group
            if group.request_id == request_id:
                self.prefilled.remove(pending)
                aborted = group.unfinished()
                for seq in aborted:
                    self._finish(seq, FinishReason.ABORT)
                self.policy.on_request_end(group)
                return aborted
        return None

    def _prefilled_stats(self) -> dict[str, float]:
        """Figures of a decode instance (`stats` asks once a prefilled request arrived)."""
        return {
            "prefilled_waiting": len(self.prefilled),
            "prefilled_admitted": self.num_prefilled["admitted"],
            "prefilled_recomputed": self.num_prefilled["recomputed"],
            "prefilled_prefix_hit_tokens": self.num_prefilled["prefix_hit_tokens"],
        }
