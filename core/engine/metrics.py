"""Per-request and per-step records, and the run summary built from them.

Times are engine-relative seconds (`Engine.now()`); summary latencies are in
milliseconds (`*_ms`), rates per second, shares in percent (`*_pct`).

Counters the parts keep cumulatively (allocator prefix hits, swapped bytes,
padding slots, preemptions) enter a `StepRecord` as that step's increase, so a
run's figure is the sum over its steps, whatever ran before it (a warm-up).
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from servelab.step.sequence import SequenceStatus

if TYPE_CHECKING:
    from servelab.step.plan import StepPlan

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


@dataclass
class StepRecord:
    step: int
    start_time: float
    wall_time: float
    num_seqs: int
    prefill_tokens: int
    decode_tokens: int
    idle_slots: int  # static batching: finished sequences still holding a slot
    preempted: int
    kv_tokens_used: int
    kv_tokens_reserved: int
    kv_tokens_capacity: int
    num_prefills: int = 0  # sequences running a prompt (or a chunk of one)
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


def percentiles(values: Iterable[float], qs=(50, 90, 99)) -> dict[str, float]:
    """Mean and the given percentiles (numpy's linear interpolation); NaN when empty."""
    arr = np.asarray(list(values), dtype=np.float64)
    if arr.size == 0:
        return {"mean": math.nan, **{f"p{q}": math.nan for q in qs}}
    return {"mean": float(arr.mean()), **{f"p{q}": float(np.percentile(arr, q)) for q in qs}}


@dataclass
class Stall:
    """The longest gaps between consecutive tokens of a decoding sequence during
    which some prefill ran (each figure maximised on its own)."""

    seconds: float = 0.0
    steps: int = 0
    prefill_tokens: int = 0  # prompt tokens computed inside one such gap


def decode_stalls(requests: Sequence[RequestRecord], steps: Sequence[StepRecord]) -> Stall:
    """A gap between tokens i and i+1 of a request spans steps
    (token_steps[i], token_steps[i+1]]; it is a stall when those steps computed
    prefill tokens (another request's prompt, or its own recompute)."""
    index = [s.step for s in steps]
    cumulative = np.concatenate([[0], np.cumsum([s.prefill_tokens for s in steps])])

    def prefill_between(after: int, upto: int) -> int:
        lo, hi = bisect.bisect_right(index, after), bisect.bisect_right(index, upto)
        return int(cumulative[hi] - cumulative[lo])

    stall = Stall()
    for req in requests:
        pairs = zip(req.token_steps, req.token_steps[1:], req.token_times, req.token_times[1:])
        for step_a, step_b, time_a, time_b in pairs:
            prefill = prefill_between(step_a, step_b)
            if prefill:
                stall.seconds = max(stall.seconds, time_b - time_a)
                stall.steps = max(stall.steps, step_b - step_a)
                stall.prefill_tokens = max(stall.prefill_tokens, prefill)
    return stall


def _pct(part: float, whole: float) -> float:
    return 100.0 * part / whole if whole else 0.0


def _latency_figures(name: str, seconds: Iterable[float]) -> dict[str, float]:
    return {f"{name}_{k}_ms": v * 1000.0 for k, v in percentiles(seconds).items()}


def _finish_steps(done: Sequence[RequestRecord], steps: Sequence[StepRecord]) -> dict:
    """`finish_step_mean` / `finish_step_p50`: how many steps from the run's first
    step each completed request took to come back (its job completion time in
    steps, the same on any machine when every request arrives at once)."""
    first = steps[0].step if steps else 0
    counts = [r.finished_step - first + 1 for r in done if r.finished_step is not None]
    if not counts:
        return {"finish_step_mean": math.nan, "finish_step_p50": math.nan}
    return {
        "finish_step_mean": float(np.mean(counts)),
        "finish_step_p50": float(np.percentile(counts, 50)),
    }


def summarize(requests: Sequence[RequestRecord], steps: Sequence[StepRecord]) -> dict[str, float]:
    """One run's figures; see docs/ablation.md for each definition."""
    done = [r for r in requests if r.completed]
    out_tokens = sum(r.output_tokens for r in done)
    prompt_tokens = sum(r.prompt_tokens for r in done)
    if steps:
        start = min([s.start_time for s in steps[:1]] + [r.arrival_time for r in requests])
        end = max(s.start_time + s.wall_time for s in steps[-1:])
        wall = max(end - start, 1e-9)
    else:
        wall = 0.0

    def per_second(x: float) -> float:
        return x / wall if wall else 0.0

    def total(attr: str) -> int:
        return sum(getattr(s, attr) for s in steps)

    step_times = [s.wall_time for s in steps]
    decode_only = [s.wall_time for s in steps if s.prefill_tokens == 0]
    with_prefill = [s.wall_time for s in steps if s.prefill_tokens > 0]
    used, reserved = total("kv_tokens_used"), total("kv_tokens_reserved")
    real_queries = total("prefill_tokens") + total("decode_tokens")
    slot_steps = total("num_seqs") + total("idle_slots")
    stall = decode_stalls(done, steps)
    summary = {
        "requests": len(done),
        "requests_total": len(requests),
        "finished_pct": _pct(len(done), len(requests)),
        "output_tokens": out_tokens,
        "prompt_tokens": prompt_tokens,
        "steps": len(steps),
        "wall_time_s": wall,
        "request_throughput": per_second(len(done)),
        "output_tok_s": per_second(out_tokens),
        "total_tok_s": per_second(out_tokens + prompt_tokens),
        **_latency_figures("ttft", (r.ttft for r in done if r.ttft is not None)),
        **_latency_figures("tpot", (r.tpot for r in done if r.tpot is not None)),
        **_latency_figures("itl", (x for r in done for x in r.itls)),
        **_latency_figures("e2e", (r.e2e for r in done)),
        **_latency_figures("queue", (r.queue_time for r in done if r.queue_time is not None)),
        "step_ms_mean": 1000.0 * float(np.mean(step_times)) if steps else math.nan,
        "decode_step_ms_mean": 1000.0 * float(np.mean(decode_only)) if decode_only else math.nan,
        "prefill_step_ms_mean": 1000.0 * float(np.mean(with_prefill)) if with_prefill else math.nan,
        "prefill_tokens": total("prefill_tokens"),
        "decode_tokens": total("decode_tokens"),
        "peak_seqs": max((s.num_seqs for s in steps), default=0),
        "mean_seqs": float(np.mean([s.num_seqs for s in steps])) if steps else 0.0,
        "kv_util_pct": float(np.mean([_pct(s.kv_tokens_used, s.kv_tokens_capacity) for s in steps]))
        if steps
        else 0.0,
        "peak_kv_util_pct": max(
            (_pct(s.kv_tokens_used, s.kv_tokens_capacity) for s in steps), default=0.0
        ),
        "peak_kv_tokens_used": max((s.kv_tokens_used for s in steps), default=0),
        "peak_kv_tokens_reserved": max((s.kv_tokens_reserved for s in steps), default=0),
        "reservation_waste_pct": _pct(reserved - used, reserved),
        "padding_waste_pct": _pct(total("padding_tokens"), total("padding_tokens") + real_queries),
        "key_padding_waste_pct": _pct(
            total("padded_key_slots"), total("padded_key_slots") + total("real_key_tokens")
        ),
        "idle_slot_pct": _pct(total("idle_slots"), slot_steps),
        "preemptions": total("preemptions_recompute") + total("preemptions_swap"),
        "preemptions_recompute": total("preemptions_recompute"),
        "preemptions_swap": total("preemptions_swap"),
        "recomputed_tokens": total("recomputed_tokens"),
        "swapped_out_bytes": total("swapped_out_bytes"),
        "swapped_in_bytes": total("swapped_in_bytes"),
        "prefix_hit_tokens": total("prefix_hit_tokens"),
        "prefix_hit_rate": (
            total("prefix_hit_tokens") / total("prefix_query_tokens")
            if total("prefix_query_tokens")
            else 0.0
        ),
        # completion time in steps (machine-independent): from the run's first step
        **_finish_steps(done, steps),
        "longest_stall_ms": 1000.0 * stall.seconds,
        "longest_stall_steps": stall.steps,
        "longest_stall_prefill_tokens": stall.prefill_tokens,
    }
    return summary


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
        self._closed: set[int] = set()  # finished since the last note_step
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

    def note_step(self, step: int, plan: StepPlan) -> None:
        """Remembers, per sequence id, its first scheduled step and its sampling
        steps, and the sequences the step preempted (swapped out, or sent back to
        recompute). Runs after the step's finished requests were recorded: their
        sequences (closed by `pop_sequence`) are skipped."""
        # the plan's decode-batch rows were scheduled before and sample one token each
        scheduled, decoded_ids, preempted = plan.items, plan.decode_seq_ids, plan.preempted
        closed = self._closed
        for seq in preempted:
            kind = "swap" if seq.status == SequenceStatus.SWAPPED else "recompute"
            self._events.setdefault(seq.seq_id, []).append([step, kind])
        token_steps = self._token_steps
        known = token_steps.get
        for seq_id in decoded_ids:  # every step, every row: no list built to be dropped
            if seq_id not in closed:
                steps = known(seq_id)
                if steps is None:
                    token_steps[seq_id] = [step]
                else:
                    steps.append(step)
        for item in scheduled:
            seq_id = item.seq.seq_id
            if seq_id in closed:
                continue
            self._first_step.setdefault(seq_id, step)
            if item.samples:
                token_steps.setdefault(seq_id, []).append(step)
        closed.clear()

    def pop_sequence(
        self, seq_id: int, current_step: int, num_tokens: int, scheduled: bool
    ) -> tuple[int | None, list[int], list[list]]:
        """(first scheduled step, step of each of its `num_tokens` tokens, its
        preemptions) of a finishing sequence. Tokens not noted yet were sampled in `current_step`
        (a request finishes inside the step, before that step is noted)."""
        self._closed.add(seq_id)
        first = self._first_step.pop(seq_id, current_step if scheduled else None)
        steps = self._token_steps.pop(seq_id, [])
        events = self._events.pop(seq_id, [])
        return first, steps + [current_step] * (num_tokens - len(steps)), events

    def summary(self) -> dict[str, float]:
        return summarize(self.requests, self.steps)
