"""The engine's records: a `RequestRecord` per finished request, a `StepRecord`
per step that ran something, and `MetricsCollector`, which builds both as the
engine runs (`servelab.engine.summary` turns them into a run's figures).

Times are engine-relative seconds (`Engine.now()`). Counters the parts keep
cumulatively (allocator prefix hits, swapped bytes, padding slots, preemptions)
enter a `StepRecord` as that step's increase, so a run's figure is the sum over
its steps, whatever ran before it (a warm-up). A token's step comes from the
executor's `SampledTokens` (who got a token), never from how the scheduler
packed the step: the decode batch stays the scheduler core's and executor's.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from servelab.contracts.attention import AttentionBackend
from servelab.step.sequence import FinishReason, SequenceStatus

if TYPE_CHECKING:
    from servelab.contracts.allocator import KVAllocator
    from servelab.contracts.executor import Executor
    from servelab.contracts.kv_tier import KVTier
    from servelab.scheduling.core import SchedulerCore
    from servelab.step.plan import SampledTokens, StepPlan
    from servelab.step.sequence import SequenceGroup

# finish reasons of requests that did not complete (the rest: "stop", "length")
UNFINISHED_REASONS = ("abort", "rejected", "cache_full", "error")
# the per-token fields of a `RequestRecord`: in `csv_row`, not in `row`
TOKEN_LISTS = ("token_times", "token_steps", "preemption_events")


@dataclass
class RequestRecord:
    request_id: str
    arrival_time: float
    prompt_tokens: int
    output_tokens: int
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float
    finish_reason: str
    preemptions: int
    token_times: list[float] = field(default_factory=list)  # the first sample's tokens
    token_steps: list[int] = field(default_factory=list)  # step index of each of those tokens
    first_scheduled_step: int | None = None
    finished_step: int | None = None  # the step that returned it (static: its batch's end)
    recomputed_tokens: int = 0
    client: str | None = None  # who sent it (add_request's client)
    # [step, "swap" | "recompute"] per preemption of the request's first sample
    preemption_events: list[list] = field(default_factory=list)
    # speculative decoding, over its samples: drafts verified, drafts kept, verifications
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    verifications: int = 0

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    @property
    def tpot(self) -> float | None:
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)

    @property
    def e2e(self) -> float:
        return self.finished_time - self.arrival_time

    @property
    def completed(self) -> bool:
        return self.finish_reason not in UNFINISHED_REASONS

    def row(self) -> dict:
        """Scalars only (the per-token lists are in `csv_row`)."""
        # a shallow copy of the scalar fields, not asdict(): that deep-copies the
        # token lists (hundreds of floats) only for them to be dropped
        row = {k: v for k, v in vars(self).items() if k not in TOKEN_LISTS}
        row.update(queue_time=self.queue_time, ttft=self.ttft, tpot=self.tpot, e2e=self.e2e)
        return row

    def csv_row(self) -> dict:
        """`row()` plus the token times and step indices as JSON lists."""
        return {
            **self.row(),
            "token_times": json.dumps([round(t, 6) for t in self.token_times]),
            "token_steps": json.dumps(self.token_steps),
            "preemption_events": json.dumps(self.preemption_events),
        }


# the allocator figures the engine reads itself (KVAllocator.usage); any other is the
# allocator's own, carried into the records as `kv_<name>`
KNOWN_USAGE = frozenset({
    "tokens_used", "tokens_reserved", "tokens_capacity", "blocks_free", "blocks_total",
    "host_blocks_free", "host_blocks_total", "prefix_hit_tokens", "prefix_query_tokens",
    "evictions",
})  # fmt: skip


def tier_counters(kv_tier: KVTier, executor: Executor) -> dict[str, float]:
    """A KV tier's cumulative counts as `tier_<figure>` (`TierFigures`); its load time
    is its own reading plus the executor's copies, in milliseconds (`tier_load_ms`),
    its store time the executor's stores (`tier_store_ms`: a disk's writes included)."""
    counts = kv_tier.figures.as_dict()
    seconds = counts.pop("read_seconds") + executor.tier_load_seconds
    return {
        **{f"tier_{k}": v for k, v in counts.items()},
        "tier_load_ms": 1e3 * seconds,
        "tier_store_ms": 1e3 * executor.tier_store_seconds,
    }


def tier_levels(kv_tier: KVTier) -> dict[str, float]:
    """The tier's own figures beyond the counts (what it holds), as `tier_<figure>`."""
    counted = kv_tier.figures.as_dict()
    return {f"tier_{k}": v for k, v in kv_tier.stats().items() if k not in counted}


@dataclass
class StepRecord:
    step: int
    start_time: float
    wall_time: float
    num_seqs: int
    prefill_tokens: int  # every token computed that is not a decode's
    decode_tokens: int  # the step's decodes (`servelab.step.plan`), one token each
    idle_slots: int  # static batching: finished sequences still holding a slot
    preempted: int
    kv_tokens_used: int
    kv_tokens_reserved: int
    kv_tokens_capacity: int
    num_prefills: int = 0  # the other sequences: a prompt or a chunk of one, a recompute
    sampled_tokens: int = 0
    padding_tokens: int = 0  # padded query slots the attention backend computed
    padded_key_slots: int = 0
    real_key_tokens: int = 0
    prefix_hit_tokens: int = 0
    prefix_query_tokens: int = 0
    swapped_out_bytes: int = 0
    swapped_in_bytes: int = 0
    preemptions_recompute: int = 0
    preemptions_swap: int = 0
    recomputed_tokens: int = 0
    waiting: int = 0
    extra: dict = field(default_factory=dict)

    def row(self) -> dict:
        # a shallow copy, not asdict(): it runs every step, for the step_end hook
        row = dict(vars(self))
        row.update(row.pop("extra"))
        return row


class MetricsCollector:
    """The engine's records, plus what it needs between steps: the last value
    of every cumulative counter, and per live sequence its first scheduled step
    and the step index of each token it sampled."""

    def __init__(self) -> None:
        self.requests: list[RequestRecord] = []
        self.steps: list[StepRecord] = []
        self._last_counters: dict[str, float] = {}
        self._first_step: dict[int, int] = {}
        self._token_steps: dict[int, list[int]] = {}
        self._closed: set[int] = set()  # finished since the last step was recorded
        self.grammar_mask_seconds = 0.0  # structured outputs: all steps' mask time
        self._events: dict[int, list[list]] = {}  # seq id -> its preemptions so far

    def start_run(self) -> None:
        """Forgets the records so far (e.g. a warm-up); counters keep their baseline."""
        self.requests.clear()
        self.steps.clear()

    def deltas(self, counters: dict[str, float]) -> dict[str, float]:
        """Cumulative counters -> their increase since the previous call."""
        out = {k: v - self._last_counters.get(k, 0) for k, v in counters.items()}
        self._last_counters.update(counters)
        return out

    def record_step(
        self,
        step: int,
        plan: StepPlan,
        sampled: SampledTokens,
        start: float,
        now: Callable[[], float],
        *,
        allocator: KVAllocator,
        scheduler: SchedulerCore,
        executor: Executor,
        backend: AttentionBackend,
        kv_tier: KVTier | None = None,
    ) -> StepRecord:
        """Records step number `step` (`sampled`: its executor's tokens; `now`: the
        engine's clock) with the parts' figures after it, and returns the record."""
        self._note_step(step, plan, sampled)
        usage = allocator.usage()
        stats = scheduler.stats() if hasattr(scheduler, "stats") else {}
        delta = self.deltas(
            {
                "prefix_hit_tokens": usage.get("prefix_hit_tokens", 0),
                "prefix_query_tokens": usage.get("prefix_query_tokens", 0),
                "evictions": usage.get("evictions", 0),
                "swapped_out_bytes": executor.bytes_swapped_out,
                "swapped_in_bytes": executor.bytes_swapped_in,
                "preemptions_recompute": stats.get("preemptions_recompute", 0),
                "preemptions_swap": stats.get("preemptions_swap", 0),
                "recomputed_tokens": stats.get("recomputed_tokens", 0),
                # speculative decoding's counts (only with a proposer): per-step increases
                **{k: v for k, v in stats.items() if k[:5] == "spec_"},
                **(tier_counters(kv_tier, executor) if kv_tier is not None else {}),
                # only a backend that keeps counters is asked for them
                **(
                    {f"attn_{k}": v for k, v in backend.stats().items()}
                    if type(backend).stats is not AttentionBackend.stats
                    else {}
                ),
            }
        )
        num_seqs, decode_tokens, sampled_tokens = plan.step_counts()
        record = StepRecord(
            step=step,
            start_time=start,
            wall_time=now() - start,
            num_seqs=num_seqs,
            prefill_tokens=plan.num_tokens - decode_tokens,
            decode_tokens=decode_tokens,
            idle_slots=plan.idle_slots,
            preempted=len(plan.preempted),
            kv_tokens_used=int(usage["tokens_used"]),
            kv_tokens_reserved=int(usage["tokens_reserved"]),
            kv_tokens_capacity=int(usage["tokens_capacity"]),
            num_prefills=num_seqs - decode_tokens,
            sampled_tokens=sampled_tokens,
            padding_tokens=int(delta.pop("attn_padded_query_slots", 0)),
            padded_key_slots=int(delta.pop("attn_padded_key_slots", 0)),
            real_key_tokens=int(delta.pop("attn_real_key_tokens", 0)),
            prefix_hit_tokens=int(delta.pop("prefix_hit_tokens")),
            prefix_query_tokens=int(delta.pop("prefix_query_tokens")),
            swapped_out_bytes=int(delta.pop("swapped_out_bytes")),
            swapped_in_bytes=int(delta.pop("swapped_in_bytes")),
            preemptions_recompute=int(delta.pop("preemptions_recompute")),
            preemptions_swap=int(delta.pop("preemptions_swap")),
            recomputed_tokens=int(delta.pop("recomputed_tokens")),
            waiting=int(stats.get("waiting", 0)),
            # what is left: evictions and any other backend counter as a per-step
            # increase, and the allocator's own figures as their values
            extra={**delta, **{f"kv_{k}": v for k, v in usage.items() if k not in KNOWN_USAGE}},
        )
        if kv_tier is not None:  # what the tier holds after the step: values, not increases
            record.extra.update(tier_levels(kv_tier))
        if sampled.grammar_mask is not None:  # structured outputs: the masks' cost
            rows, seconds = sampled.grammar_mask
            self.grammar_mask_seconds += seconds
            record.extra["grammar_masked_rows"] = rows
            record.extra["grammar_mask_ms"] = seconds * 1e3
        self.steps.append(record)
        return record

    def _note_step(self, step: int, plan: StepPlan, sampled: SampledTokens) -> None:
        """Remembers, per sequence id, its first scheduled step and its sampling
        steps, and the sequences the step preempted (swapped out, or sent back to
        recompute). Runs after the step's finished requests were recorded: their
        sequences (closed by `_pop_sequence`) are skipped."""
        closed = self._closed
        for seq in plan.preempted:
            kind = "swap" if seq.status == SequenceStatus.SWAPPED else "recompute"
            self._events.setdefault(seq.seq_id, []).append([step, kind])
        token_steps = self._token_steps
        known = token_steps.get
        previous = None
        # every sequence that got a token, once (a prompt that forks owns n entries in a
        # row); every step, every row: no list built to be dropped
        if plan.draft_counts is not None:  # a verified row got several tokens
            self._note_verified(step, plan, sampled)
        for seq_id in sampled.owners:
            if seq_id != previous and seq_id not in closed:
                steps = known(seq_id)
                if steps is None:
                    token_steps[seq_id] = [step]
                else:
                    steps.append(step)
            previous = seq_id
        first_step = self._first_step
        for seq in plan.listed:  # a sequence's first step lists it (StepPlan)
            seq_id = seq.seq_id
            if seq_id not in closed:
                first_step.setdefault(seq_id, step)
        closed.clear()

    def _note_verified(self, step: int, plan: StepPlan, sampled: SampledTokens) -> None:
        """The steps of a verified row's tokens past its first (`_note_step` notes that)."""
        assert plan.draft_counts is not None
        verified = {s.seq_id for s, d in zip(plan.seqs, plan.draft_counts.tolist()) if d}
        extra: dict[int, int] = {}
        for seq_id in sampled.owners:
            if seq_id in verified:
                extra[seq_id] = extra.get(seq_id, -1) + 1
        for seq_id, count in extra.items():
            if count and seq_id not in self._closed:
                self._token_steps.setdefault(seq_id, []).extend([step] * count)

    def note_transferred_token(self, seq_id: int, step: int) -> None:
        """A sequence arrives with its first token sampled on another instance: that
        token counts as sampled in `step`, so its record's token_steps stay in order."""
        self._token_steps[seq_id] = [step]

    def record_request(self, group: SequenceGroup, now: float, step: int) -> RequestRecord:
        """Records a request finishing at `now`, in step number `step` (the running
        one), and returns the record."""
        first = group.seqs[0]
        first_step, token_steps, events = self._pop_sequence(
            first.seq_id,
            step,
            len(first.token_times),
            scheduled=first.first_scheduled_time is not None,
        )
        for seq in group.seqs[1:]:
            self._pop_sequence(seq.seq_id, step, 0, scheduled=True)
        record = RequestRecord(
            request_id=group.request_id,
            arrival_time=first.arrival_time,
            prompt_tokens=first.num_prompt_tokens,
            output_tokens=sum(s.num_output_tokens for s in group.seqs),
            first_scheduled_time=first.first_scheduled_time,
            first_token_time=first.token_times[0] if first.token_times else None,
            finished_time=now,
            finish_reason=(first.finish_reason or FinishReason.ABORT).value,
            preemptions=max(s.num_preemptions for s in group.seqs),
            token_times=list(first.token_times),
            token_steps=token_steps,
            first_scheduled_step=first_step,
            finished_step=step,
            recomputed_tokens=sum(s.num_recomputed_tokens for s in group.seqs),
            client=first.client,
            preemption_events=events,
            drafted_tokens=sum(s.num_drafted_tokens for s in group.seqs),
            accepted_tokens=sum(s.num_accepted_tokens for s in group.seqs),
            verifications=sum(s.num_verifications for s in group.seqs),
        )
        self.requests.append(record)
        return record

    def _pop_sequence(
        self, seq_id: int, current_step: int, num_tokens: int, scheduled: bool
    ) -> tuple[int | None, list[int], list[list]]:
        """(first scheduled step, step of each of its `num_tokens` tokens, its
        preemptions) of a finishing sequence. Tokens not noted yet were sampled in `current_step`
        (a request finishes inside the step, before that step is noted)."""
        self._closed.add(seq_id)
        first = self._first_step.pop(seq_id, current_step if scheduled else None)
        steps = self._token_steps.pop(seq_id, [])
        events = self._events.pop(seq_id, [])
        # a stop inside a verified run keeps fewer tokens than the step sampled
        steps = steps[:num_tokens] + [current_step] * (num_tokens - len(steps))
        return first, steps, events
