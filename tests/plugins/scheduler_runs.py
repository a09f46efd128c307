"""Drives a tiny-model engine request by request, for the schedulers' decision-rule tests."""

from __future__ import annotations

from servelab import LLM, SamplingParams

KIB = 1024


def engine(scheduler: dict, **options):
    """One sequence at a time unless `max_num_seqs` says otherwise: admission order is visible."""
    settings = dict(dtype="float32", max_model_len=64, kv_cache_memory=64 * KIB, max_num_seqs=1)
    settings.update(options)
    return LLM(model="tiny", scheduler=scheduler, **settings).engine


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def step_until(eng, done=lambda eng: not eng.has_unfinished(), limit: int = 500) -> dict:
    """Steps until `done(eng)`; returns the outputs by request id."""
    outputs = {}
    for _ in range(limit):
        if done(eng):
            return outputs
        for out in eng.step():
            outputs[out.request_id] = out
    raise AssertionError("no end")


def records(eng) -> dict:
    return {r.request_id: r for r in eng.metrics.requests}


def admission_order(eng) -> list[str]:
    recs = records(eng)
    return sorted(recs, key=lambda r: (recs[r].first_scheduled_step, recs[r].arrival_time))
