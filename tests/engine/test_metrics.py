"""Metrics: percentiles and the run summary against hand-derived values on a
fixed small record; the engine's per-step and per-request records against
what its parts report independently."""

from __future__ import annotations

import json
import math
from dataclasses import fields

import numpy as np
import pytest

from servelab.engine.build import build_engine
from servelab.engine.metrics import TOKEN_LISTS, RequestRecord, StepRecord
from servelab.engine.summary import decode_stalls, longest_stall, percentiles, summarize
from servelab.lab.runner import run_config, serve
from servelab.lab.workload import make_workload
from servelab.step.sequence import SamplingParams

# -- percentiles


def test_percentiles_match_hand_derived_linear_interpolation():
    # numpy's default: position q/100 * (n - 1), linear between neighbours
    # 1..10: p50 at 4.5 -> 5.5; p90 at 8.1 -> 9.1; p99 at 8.91 -> 9.91
    got = percentiles(range(1, 11))
    assert got == pytest.approx({"mean": 5.5, "p50": 5.5, "p90": 9.1, "p99": 9.91})
    # 40, 10, 30, 20 (unsorted): p50 at 1.5 -> 25; p90 at 2.7 -> 37; p99 at 2.97 -> 39.7
    got = percentiles([40, 10, 30, 20])
    assert got == pytest.approx({"mean": 25.0, "p50": 25.0, "p90": 37.0, "p99": 39.7})
    assert percentiles([7.0]) == {"mean": 7.0, "p50": 7.0, "p90": 7.0, "p99": 7.0}
    assert all(math.isnan(v) for v in percentiles([]).values())


# -- a fixed small record, every figure derived by hand
#
# step  start  wall  prefill decode seqs idle  kv used/reserved/cap  padding  other
#  0    0.00   0.10    4      0      1    0       4 / 16 / 100           0     prefix query 4
#  1    0.10   0.10    0      1      1    1       5 / 16 / 100           0
#  2    0.20   0.15    6      0      1    0      11 / 32 / 100           0     prefix query 6, hit 3;
#                                                                               1 recompute preemption, 3 tokens
#  3    0.35   0.05    0      2      2    0      13 / 32 / 100           2
# r0: arrives 0.00, scheduled 0.00, tokens at 0.10 (step 0), 0.20 (step 1), 0.40 (step 3); prompt 4
# r1: arrives 0.05, scheduled 0.20, tokens at 0.35 (step 2), 0.40 (step 3); prompt 6


def fixed_record():
    steps = [
        StepRecord(0, 0.00, 0.10, 1, 4, 0, 0, 0, 4, 16, 100, prefix_query_tokens=4),
        StepRecord(1, 0.10, 0.10, 1, 0, 1, 1, 0, 5, 16, 100),
        StepRecord(2, 0.20, 0.15, 1, 6, 0, 0, 1, 11, 32, 100, prefix_query_tokens=6,
                   prefix_hit_tokens=3, preemptions_recompute=1, recomputed_tokens=3),
        StepRecord(3, 0.35, 0.05, 2, 0, 2, 0, 0, 13, 32, 100, padding_tokens=2),
    ]  # fmt: skip
    requests = [
        RequestRecord("r0", 0.00, 4, 3, 0.00, 0.10, 0.40, "length", 0,
                      token_times=[0.10, 0.20, 0.40], token_steps=[0, 1, 3]),
        RequestRecord("r1", 0.05, 6, 2, 0.20, 0.35, 0.40, "stop", 1,
                      token_times=[0.35, 0.40], token_steps=[2, 3]),
    ]  # fmt: skip
    return requests, steps


def test_summary_of_the_fixed_record():
    s = summarize(*fixed_record())
    assert s["requests"] == 2 and s["output_tokens"] == 5 and s["prompt_tokens"] == 10
    assert s["wall_time_s"] == pytest.approx(0.40)  # first arrival 0.00 to last step end 0.40
    assert s["request_throughput"] == pytest.approx(2 / 0.4)
    assert s["output_tok_s"] == pytest.approx(5 / 0.4)
    assert s["total_tok_s"] == pytest.approx(15 / 0.4)
    # TTFT 100 and 300 ms: p90 at 0.9 -> 100 + 0.9 * 200
    assert s["ttft_mean_ms"] == pytest.approx(200)
    assert s["ttft_p50_ms"] == pytest.approx(200)
    assert s["ttft_p90_ms"] == pytest.approx(280)
    # ITLs: r0 100, 200; r1 50 -> sorted 50, 100, 200; p90 at 1.8 -> 100 + 0.8 * 100
    assert s["itl_mean_ms"] == pytest.approx(350 / 3)
    assert s["itl_p50_ms"] == pytest.approx(100)
    assert s["itl_p90_ms"] == pytest.approx(180)
    # TPOT: r0 (400 - 100) / 2 = 150, r1 50; e2e 400 and 350; queue 0 and 150
    assert s["tpot_mean_ms"] == pytest.approx(100)
    assert s["e2e_p50_ms"] == pytest.approx(375)
    assert s["queue_mean_ms"] == pytest.approx(75)
    # KV: reserved 96 token-steps of which 33 used
    assert s["reservation_waste_pct"] == pytest.approx(100 * (96 - 33) / 96)
    assert s["kv_util_pct"] == pytest.approx((4 + 5 + 11 + 13) / 4)
    assert s["peak_kv_tokens_used"] == 13 and s["peak_seqs"] == 2
    # padding: 2 padded slots next to 13 real query tokens; idle: 1 of 6 slot-steps
    assert s["padding_waste_pct"] == pytest.approx(100 * 2 / 15)
    assert s["idle_slot_pct"] == pytest.approx(100 / 6)
    assert s["preemptions"] == 1 and s["recomputed_tokens"] == 3
    assert s["prefix_hit_rate"] == pytest.approx(3 / 10)
    assert s["prefill_tokens"] == 10 and s["decode_tokens"] == 3
    assert s["step_ms_mean"] == pytest.approx(100)
    assert s["decode_step_ms_mean"] == pytest.approx(75)  # steps 1 and 3
    # r0's gap from step 1 to step 3 holds step 2's 6 prefill tokens: 200 ms, 2 steps
    assert s["longest_stall_ms"] == pytest.approx(200)
    assert s["longest_stall_steps"] == 2
    assert s["longest_stall_prefill_tokens"] == 6


def test_gaps_without_prefill_are_not_stalls():
    requests, steps = fixed_record()
    steps[2].prefill_tokens = 0
    stall = decode_stalls(requests, steps)
    assert (stall.seconds, stall.steps, stall.prefill_tokens) == (0.0, 0, 0)


def test_unfinished_requests_count_in_the_total_only():
    requests, steps = fixed_record()
    requests.append(RequestRecord("r2", 0.1, 5, 0, None, None, 0.4, "abort", 0))
    s = summarize(requests, steps)
    assert s["requests"] == 2 and s["requests_total"] == 3
    assert s["finished_pct"] == pytest.approx(200 / 3)


def test_request_row_is_every_scalar_field_then_the_latencies():
    (r0, _), _ = fixed_record()
    aborted = RequestRecord("r2", 0.1, 5, 0, None, None, 0.4, "abort", 0)
    scalars = [f.name for f in fields(RequestRecord) if f.name not in TOKEN_LISTS]
    latencies = ["queue_time", "ttft", "tpot", "e2e"]
    for record, hand in [
        # r0: scheduled at arrival; first token 0.10; (0.40 - 0.10) / 2 per token; done at 0.40
        (r0, [0.0, 0.10, 0.15, 0.40]),
        # never scheduled, no token: only its end-to-end time, 0.4 - 0.1
        (aborted, [None, None, None, 0.3]),
    ]:
        row = record.row()
        assert list(row) == scalars + latencies  # the CSV's column order
        assert all(row[name] == getattr(record, name) for name in scalars)
        assert [row[name] for name in latencies] == [
            v if v is None else pytest.approx(v) for v in hand
        ]
    csv = r0.csv_row()
    assert json.loads(csv["token_times"]) == r0.token_times
    assert json.loads(csv["token_steps"]) == r0.token_steps
    # the row is the record's copy: changing it leaves the record as it was
    row = r0.row()
    row["prompt_tokens"] = -1
    assert r0.prompt_tokens == 4 and r0.row()["prompt_tokens"] == 4


# -- the engine's records


def tiny(**parts):
    engine = parts.pop("engine", {})
    return build_engine({"model": "tiny", **parts, "engine": {"num_threads": 1, **engine}})


def mixed_lengths(engine, scale=0.1):
    return make_workload({"name": "mixed_lengths", "scale": scale}, engine.model_config.vocab_size)


@pytest.mark.parametrize(
    "scheduler", ["continuous", {"name": "chunked", "chunk_size": 4}, "static"]
)
def test_every_token_has_the_step_that_sampled_it(scheduler):
    engine = tiny(scheduler=scheduler, engine={"max_num_seqs": 4})
    serve(engine, mixed_lengths(engine))
    steps = {s.step: s for s in engine.metrics.steps}
    assert len(engine.metrics.requests) == 8
    for record in engine.metrics.requests:
        assert len(record.token_steps) == len(record.token_times) == record.output_tokens
        assert record.token_steps == sorted(set(record.token_steps))
        for step, when in zip(record.token_steps, record.token_times):
            assert steps[step].start_time <= when <= steps[step].start_time + steps[step].wall_time
        assert record.first_scheduled_step <= record.token_steps[0]
        assert record.finished_step >= record.token_steps[-1]
        if scheduler == "continuous":
            assert record.finished_step == record.token_steps[-1]
    if scheduler == "static":  # a batch's members are all released when its longest ends
        for record in engine.metrics.requests:
            batch = [
                r
                for r in engine.metrics.requests
                if r.first_scheduled_step == record.first_scheduled_step
            ]
            assert record.finished_step == max(r.token_steps[-1] for r in batch)
    # nothing is left behind for finished sequences
    assert not engine.metrics._token_steps and not engine.metrics._first_step


def test_a_forking_prompt_gives_its_first_sample_one_step_per_token():
    """A prompt with n samples forks in the step that samples it: the executor's
    sampled tokens list the parent n times there, and its record still gets that
    step once, like every later token's step (the decode batch's or not)."""
    engine = tiny(engine={"max_num_seqs": 4})
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=5, ignore_eos=True)
    engine.add_request([3, 9, 4, 7, 5], params, request_id="forked")
    engine.add_request([6, 2, 8], SamplingParams(max_tokens=5, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    record = next(r for r in engine.metrics.requests if r.request_id == "forked")
    assert record.output_tokens == 3 * 5
    # one prefill step, then one decode step per token: steps k .. k+4
    first = record.first_scheduled_step
    assert record.token_steps == list(range(first, first + 5))
    assert len(record.token_times) == 5


def test_per_step_counters_add_up_to_the_parts_own_totals():
    engine = tiny(
        allocator={"name": "paged", "block_size": 4, "prefix_caching": True},
        preemption="swap",
        attention="padded",
        engine={"kv_cache_memory": 64 * 512, "max_model_len": 64, "max_num_seqs": 8},
    )
    node = {
        "name": "synthetic",
        "num_requests": 8,
        "shared_prefix_len": 12,
        "shared_fraction": 1.0,
        "prompt_len": {"dist": "fixed", "mean": 4},
        "output_len": {"dist": "fixed", "mean": 24},
    }
    serve(engine, make_workload(node, engine.model_config.vocab_size, 64))
    steps = engine.metrics.steps
    usage, stats, attn = engine.allocator.usage(), engine.scheduler.stats(), engine.backend.stats()
    assert sum(s.prefix_hit_tokens for s in steps) == usage["prefix_hit_tokens"] > 0
    assert sum(s.swapped_out_bytes for s in steps) == engine.executor.bytes_swapped_out > 0
    assert sum(s.swapped_in_bytes for s in steps) == engine.executor.bytes_swapped_in
    assert sum(s.preemptions_swap + s.preemptions_recompute for s in steps) == (
        stats["preemptions_swap"] + stats["preemptions_recompute"]
    )
    assert sum(s.padding_tokens for s in steps) == attn["padded_query_slots"]
    assert sum(s.padded_key_slots for s in steps) == attn["padded_key_slots"]


def test_padding_of_one_step_matches_the_batch_shape():
    engine = tiny(attention="padded")
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    engine.add_request([3, 4, 5], params)
    engine.add_request([3, 4, 5, 6, 7], params)
    engine.step()
    (step,) = engine.metrics.steps
    # two prompts padded to the longest: 2 x 5 query slots for 8 tokens
    assert step.padding_tokens == 2 * 5 - 8
    assert step.prefill_tokens == 8 and step.num_prefills == 2 and step.sampled_tokens == 2


def test_warm_up_stays_out_of_the_run():
    result = run_config(
        {
            "model": "tiny",
            "engine": {"num_threads": 1},
            "workload": {"name": "mixed_lengths", "scale": 0.05},
            "run": {"progress": False, "warmup": True},
        }
    )
    assert {r.request_id for r in result.requests} == {f"mixed-{i}" for i in range(8)}
    # the warm-up's prompt and its two tokens are not counted
    assert result.summary["prefill_tokens"] == sum(r.prompt_tokens for r in result.requests)
    assert sum(s.sampled_tokens for s in result.steps) == result.summary["output_tokens"]


def test_static_idle_slots_are_the_finished_members_of_the_running_batch():
    engine = tiny(scheduler="static")
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (2, 5)]
    for p in params:
        engine.add_request([3, 4, 5], p)
    while engine.has_unfinished():
        engine.step()
    idle = [s.idle_slots for s in engine.metrics.steps]
    # the 2-token request finishes at step 1 and idles for steps 2..4
    assert idle == [0, 0, 1, 1, 1]
    assert summarize(engine.metrics.requests, engine.metrics.steps)[
        "idle_slot_pct"
    ] == pytest.approx(100 * 3 / 10)


@pytest.mark.parametrize(
    ("scheduler", "bound"), [("continuous", 64), ({"name": "chunked", "chunk_size": 16}, 16)]
)
def test_a_long_prompt_stalls_decodes_by_its_prefill_or_one_chunk(scheduler, bound):
    engine = tiny(scheduler=scheduler)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    for _ in range(4):
        engine.add_request([3, 4, 5, 6], params)
    for _ in range(3):
        engine.step()
    engine.add_request(np.arange(2, 66).tolist(), SamplingParams(temperature=0.0, max_tokens=2))
    while engine.has_unfinished():
        engine.step()
    stall = decode_stalls(engine.metrics.requests, engine.metrics.steps)
    assert stall.prefill_tokens == bound
    assert stall.steps == 1  # decodes run first: no decode ever skips a step


def test_finish_steps_count_from_the_runs_first_step():
    steps = [StepRecord(s, 0.1 * s, 0.1, 2, 0, 2, 0, 0, 8, 8, 64) for s in range(10, 15)]
    done = [
        RequestRecord("a", 0.0, 4, 2, 0.0, 0.1, 0.2, "length", 0, finished_step=11),
        RequestRecord("b", 0.0, 4, 4, 0.0, 0.1, 0.4, "length", 0, finished_step=13),
        RequestRecord("c", 0.0, 4, 5, 0.0, 0.1, 0.5, "length", 0, finished_step=14),
        RequestRecord("d", 0.0, 4, 0, None, None, 0.5, "abort", 0, finished_step=12),
    ]
    summary = summarize(done, steps)
    # a, b, c came back after 2, 4 and 5 steps of a run starting at step 10; d did not complete
    assert summary["finish_step_mean"] == pytest.approx(11 / 3)
    assert summary["finish_step_p50"] == 4


def test_a_clusters_longest_stall_reads_each_engine_against_its_own_steps():
    """Two engines numbering their steps alike: engine A is the fixed record (r0's gap over
    A's step 2, 6 prefill tokens, 200 ms); engine B computes 100 prefill tokens in its own
    step 2 while its one request's tokens fall at its steps 0 and 1. A's requests never
    waited on B's prefill, so the stall is A's alone."""
    a_requests, a_steps = fixed_record()
    _, b_steps = fixed_record()
    for step in b_steps:
        step.prefill_tokens = 100 if step.step == 2 else 0
    b_request = RequestRecord("b0", 0.0, 4, 2, 0.0, 0.05, 0.2, "length", 0,
                              token_times=[0.05, 0.15], token_steps=[0, 1])  # fmt: skip
    mixed = summarize([*a_requests, b_request], sorted([*a_steps, *b_steps],
                                                       key=lambda s: s.start_time))  # fmt: skip
    assert mixed["longest_stall_prefill_tokens"] > 6  # read against both engines' steps
    figures = longest_stall([(a_requests, a_steps), ([b_request], b_steps)])
    assert figures == {"longest_stall_ms": pytest.approx(200), "longest_stall_steps": 2,
                       "longest_stall_prefill_tokens": 6}  # fmt: skip
    told = summarize([*a_requests, b_request], sorted([*a_steps, *b_steps],
                                                      key=lambda s: s.start_time),
                     engines=[(a_requests, a_steps), ([b_request], b_steps)])  # fmt: skip
    assert {k: told[k] for k in figures} == figures
