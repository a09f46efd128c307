"""Per-request and per-step records, and the run summary built from them."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np


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
    token_times: list[float] = field(default_factory=list)

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

    def row(self) -> dict:
        row = asdict(self)
        row.pop("token_times")
        row.update(queue_time=self.queue_time, ttft=self.ttft, tpot=self.tpot, e2e=self.e2e)
        return row


@dataclass
class StepRecord:
    step: int
    start_time: float
    wall_time: float
    num_seqs: int
    prefill_tokens: int
    decode_tokens: int
    idle_slots: int
    preempted: int
    kv_tokens_used: int
    kv_tokens_reserved: int
    kv_tokens_capacity: int
    extra: dict = field(default_factory=dict)

    def row(self) -> dict:
        row = asdict(self)
        row.update(row.pop("extra"))
        return row


def percentiles(values: list[float], qs=(50, 90, 99)) -> dict[str, float]:
    """Mean and the given percentiles (numpy's linear interpolation); NaN when empty."""
    if not values:
        return {"mean": float("nan"), **{f"p{q}": float("nan") for q in qs}}
    arr = np.asarray(values, dtype=np.float64)
    return {"mean": float(arr.mean()), **{f"p{q}": float(np.percentile(arr, q)) for q in qs}}


class MetricsCollector:
    def __init__(self) -> None:
        self.requests: list[RequestRecord] = []
        self.steps: list[StepRecord] = []

    def summary(self) -> dict[str, float]:
        reqs = self.requests
        done = [r for r in reqs if r.finish_reason not in ("abort", "rejected")]
        out_tokens = sum(r.output_tokens for r in done)
        prompt_tokens = sum(r.prompt_tokens for r in done)
        if self.steps:
            start = min(min((r.arrival_time for r in reqs), default=0.0), self.steps[0].start_time)
            end = self.steps[-1].start_time + self.steps[-1].wall_time
            wall = max(end - start, 1e-9)
        else:
            wall = 0.0
        ttft = percentiles([r.ttft for r in done if r.ttft is not None])
        tpot = percentiles([r.tpot for r in done if r.tpot is not None])
        peak_used = max((s.kv_tokens_used for s in self.steps), default=0)
        peak_reserved = max((s.kv_tokens_reserved for s in self.steps), default=0)
        return {
            "requests": len(done),
            "output_tokens": out_tokens,
            "prompt_tokens": prompt_tokens,
            "steps": len(self.steps),
            "wall_time_s": wall,
            "output_tok_s": out_tokens / wall if wall else 0.0,
            "total_tok_s": (out_tokens + prompt_tokens) / wall if wall else 0.0,
            "mean_ttft_s": ttft["mean"],
            "mean_tpot_s": tpot["mean"],
            "peak_kv_tokens_used": peak_used,
            "peak_kv_tokens_reserved": peak_reserved,
            "preemptions": sum(r.preemptions for r in reqs),
        }
