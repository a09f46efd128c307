"""A run's figures from its records (`servelab.engine.metrics`): latency
percentiles, throughput, KV use, padding, preemptions, decode stalls.

Pure functions over `RequestRecord` and `StepRecord` lists, so a run read back
from disk, or several engines' records put together (a cluster), summarise the
same way as one engine's. Times in the records are seconds; summary latencies
are in milliseconds (`*_ms`), rates per second, shares in percent (`*_pct`).
See docs/ablation.md for each figure's definition.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from servelab.engine.metrics import RequestRecord, StepRecord


def percentiles(values: Iterable[float], qs=(50, 90, 99)) -> dict[str, float]:
    """Mean and the given percentiles (numpy's linear interpolation); NaN when empty."""
    arr = values if isinstance(values, np.ndarray) else np.asarray(list(values), dtype=np.float64)
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


def _end_to_end(lists: list[list], dtype: type) -> tuple[np.ndarray, np.ndarray]:
    """The lists' values end to end, and which consecutive pairs of them lie within one
    list (the rest join one list's last value to the next's first)."""
    lengths = np.fromiter(map(len, lists), np.int64, len(lists))
    flat: np.ndarray = np.fromiter(itertools.chain.from_iterable(lists), dtype, int(lengths.sum()))
    within = np.ones(max(len(flat) - 1, 0), dtype=bool)
    last = np.cumsum(lengths) - 1  # each list's last value
    within[last[(last >= 0) & (last < len(within))]] = False
    return flat, within


def inter_token_gaps(requests: Sequence[RequestRecord]) -> np.ndarray:
    """Every request's `itls` (the gaps between its consecutive token times), in order."""
    times, within = _end_to_end([r.token_times for r in requests], np.float64)
    return (times[1:] - times[:-1])[within]


def decode_stalls(requests: Sequence[RequestRecord], steps: Sequence[StepRecord]) -> Stall:
    """A gap between tokens i and i+1 of a request spans steps
    (token_steps[i], token_steps[i+1]]; it is a stall when those steps computed
    prefill tokens (another request's prompt, or its own recompute)."""
    index = [s.step for s in steps]
    cumulative = list(itertools.accumulate((s.prefill_tokens for s in steps), initial=0))
    # every request's tokens end to end (its steps and times, cut to the shorter list)
    lengths = [min(len(r.token_steps), len(r.token_times)) for r in requests]
    token_steps, within = _end_to_end(
        [r.token_steps[:n] for r, n in zip(requests, lengths)], np.int64
    )
    token_times, _ = _end_to_end([r.token_times[:n] for r, n in zip(requests, lengths)], np.float64)
    stall = Stall()
    if len(token_steps) < 2:
        return stall
    # the prefill tokens of the steps up to each token's (bisected as a list: a cluster's
    # replicas number their steps apart), looked up once per step number
    first = int(token_steps.min())
    upto = np.array(
        [cumulative[bisect.bisect_right(index, step)]
         for step in range(first, int(token_steps.max()) + 1)], np.int64
    )[token_steps - first]  # fmt: skip
    prefill = upto[1:] - upto[:-1]
    # a gap is between two tokens of one request, never from one request's last to the next's
    gaps = np.flatnonzero((prefill != 0) & within)
    if len(gaps):
        stall.seconds = max(stall.seconds, float((token_times[gaps + 1] - token_times[gaps]).max()))
        stall.steps = max(stall.steps, int((token_steps[gaps + 1] - token_steps[gaps]).max()))
        stall.prefill_tokens = max(stall.prefill_tokens, int(prefill[gaps].max()))
    return stall


def longest_stall(
    engines: Iterable[tuple[Sequence[RequestRecord], Sequence[StepRecord]]],
) -> dict[str, float]:
    """The longest decode stall figures over several engines, each given as its requests
    and its own steps: a request's gap spans steps of the engine that ran it, and another
    engine's step numbers say nothing about it (a cluster's replicas each count their own)."""
    worst = Stall()
    for requests, steps in engines:
        one = decode_stalls([r for r in requests if r.completed], steps)
        worst.seconds = max(worst.seconds, one.seconds)
        worst.steps = max(worst.steps, one.steps)
        worst.prefill_tokens = max(worst.prefill_tokens, one.prefill_tokens)
    return {
        "longest_stall_ms": 1000.0 * worst.seconds,
        "longest_stall_steps": worst.steps,
        "longest_stall_prefill_tokens": worst.prefill_tokens,
    }


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


def summarize(
    requests: Sequence[RequestRecord],
    steps: Sequence[StepRecord],
    engines: Iterable[tuple[Sequence[RequestRecord], Sequence[StepRecord]]] | None = None,
) -> dict[str, float]:
    """One run's figures; see docs/ablation.md for each definition. Several engines' records
    put together (a cluster) give `engines`, each engine's own requests and steps, for the
    figures that read a request against its engine's steps (the longest stall)."""
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

    # the allocator's own figures (`kv_<name>`): their values after the last step
    allocator_own = {k: v for k, v in (steps[-1].extra if steps else {}).items() if k[:3] == "kv_"}

    step_times = [s.wall_time for s in steps]
    decode_only = [s.wall_time for s in steps if s.prefill_tokens == 0]
    with_prefill = [s.wall_time for s in steps if s.prefill_tokens > 0]
    used, reserved = total("kv_tokens_used"), total("kv_tokens_reserved")
    real_queries = total("prefill_tokens") + total("decode_tokens")
    slot_steps = total("num_seqs") + total("idle_slots")
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
        **_latency_figures("itl", inter_token_gaps(done)),
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
        "evictions": sum(s.extra.get("evictions", 0) for s in steps),
        **allocator_own,
        # completion time in steps (machine-independent): from the run's first step
        **_finish_steps(done, steps),
        **longest_stall([(done, steps)] if engines is None else engines),
        **_speculation(steps),
        **_tiers(steps),
    }
    return summary


# a KV tier's per-step counts (servelab.engine.metrics.tier_counters): summed over the run
TIER_COUNTS = ("tier_hits", "tier_misses", "tier_hit_tokens", "tier_blocks_stored",
               "tier_blocks_dropped", "tier_blocks_evicted", "tier_load_failures",
               "tier_bytes_loaded", "tier_bytes_stored", "tier_load_ms", "tier_store_ms")  # fmt: skip


def _tiers(steps: Sequence[StepRecord]) -> dict[str, float]:
    """A KV tier's figures, for a run with one: its counts summed, the share of the
    blocks missing on the device that it served (`tier_hit_rate`), and what it held
    after the last step (`tier_<level>`)."""
    if not steps or "tier_hits" not in steps[-1].extra:
        return {}
    out = {k: sum(s.extra.get(k, 0) for s in steps) for k in TIER_COUNTS}
    looked_up = out["tier_hits"] + out["tier_misses"]
    out["tier_hit_rate"] = out["tier_hits"] / looked_up if looked_up else 0.0
    levels = {k: v for k, v in steps[-1].extra.items() if k[:5] == "tier_" and k not in out}
    return out | levels


def _speculation(steps: Sequence[StepRecord]) -> dict[str, float]:
    """Speculative decoding's figures, for a run with a proposer (its steps carry
    the counts): drafts offered and kept, the share kept, the mean accepted
    length (tokens a verification produces: kept drafts + the target's own, as
    vLLM's "mean acceptance length"), and the share of verifications that kept
    draft i, by position."""
    if not steps or "spec_num_drafts" not in steps[-1].extra:
        return {}
    counts: dict[str, float] = {}
    for s in steps:
        for k, v in s.extra.items():
            if k[:5] == "spec_":
                counts[k] = counts.get(k, 0) + v
    verifications = counts.pop("spec_num_drafts")
    drafted = counts.pop("spec_num_draft_tokens")
    accepted = counts.pop("spec_num_accepted_tokens")
    errors = counts.pop("spec_proposer_errors", 0)
    paused = counts.pop("spec_paused_steps", 0)
    out = {
        "spec_verifications": verifications,
        "spec_draft_tokens": drafted,
        "spec_accepted_tokens": accepted,
        "spec_acceptance_pct": _pct(accepted, drafted),
        "spec_mean_accepted_length": 1 + accepted / verifications if verifications else math.nan,
        "spec_proposer_errors": errors,
        "spec_paused_steps": paused,
    }
    for key in sorted(counts, key=lambda k: int(k.rsplit("_", 1)[1])):
        position = int(key.rsplit("_", 1)[1])
        out[f"spec_accepted_pct_pos{position}"] = _pct(counts[key], verifications)
    return out
