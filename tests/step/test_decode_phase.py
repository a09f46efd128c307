"""The decode phase (`servelab.scheduling.core.DecodePhase`: the running sequences planned
at once from arrays while they all decode) changes how a step is planned, never what
happens: with it on or off (`decode_phase.enabled`), every
request's tokens, finish reasons and every step's record (sequences, prefill
and decode tokens, KV tokens used and reserved, prefix hits, swaps,
preemptions) are the same, under random workloads that admit, finish, stop,
fork, abort, share prefixes and preempt. The rows mirror the running
sequences after every step (`check_integrity`), and it really runs."""

from __future__ import annotations

import dataclasses

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings

from servelab import LLM, RequestError, SamplingParams

KIB = 1024  # the float32 tiny model stores 512 B of K/V per token: 2 tokens a KiB
MAX_MODEL_LEN = 64
TIMING_FIELDS = {"start_time", "wall_time"}


def run(fast: bool, requests, engine: dict, arrive_at: dict[int, int], abort_at: dict[int, int]):
    """Steps an engine to the end (requests arrive and abort at given steps);
    returns (outputs by request id, step records without times, fast steps)."""
    llm = LLM(model="tiny", dtype="float32", max_model_len=MAX_MODEL_LEN, **engine)
    eng = llm.engine
    eng.scheduler.decode_phase.enabled = fast
    schedule, fast_steps = eng.scheduler.schedule, []

    def counting_schedule():
        plan = schedule()
        fast_steps.append(plan.running_rows is not None)
        return plan

    eng.scheduler.schedule = counting_schedule
    outputs, step = {}, 0
    pending = dict(enumerate(requests))
    while pending or eng.has_unfinished():
        for i in [i for i in pending if arrive_at.get(i, 0) <= step]:
            prompt, params, priority = pending.pop(i)
            try:
                eng.add_request(prompt, params, request_id=f"r{i}", priority=priority)
            except RequestError as err:
                outputs[f"r{i}"] = ("rejected", str(err))
        for i, when in abort_at.items():
            if when == step and eng.abort(f"r{i}") is not None:
                outputs[f"r{i}"] = ("aborted",)
        for out in eng.step():
            outputs[out.request_id] = (
                [(c.token_ids, c.finish_reason) for c in out.outputs],
                out.metrics["preemptions"],
                out.metrics["output_tokens"],
            )
        eng.allocator.check_integrity()
        eng.scheduler.check_integrity()
        step += 1
        assert step < 3000, "no progress"
    usage = eng.allocator.usage()
    assert usage["blocks_free"] == usage["blocks_total"], "device blocks leaked"
    records = [
        {k: v for k, v in dataclasses.asdict(r).items() if k not in TIMING_FIELDS}
        for r in eng.metrics.steps
    ]
    return outputs, records, sum(fast_steps)


SHARED = [9, 8, 7, 6, 5, 4, 3, 2, 9, 8, 7, 6]


@st.composite
def workloads(draw):
    items = []
    for _ in range(draw(st.integers(3, 9))):
        body = draw(st.lists(st.integers(10, 500), min_size=1, max_size=20))
        prompt = (SHARED + body) if draw(st.booleans()) else body
        sampled = draw(st.booleans())
        params = SamplingParams(
            temperature=0.8 if sampled else 0.0,
            seed=draw(st.integers(0, 99)) if sampled else None,
            max_tokens=draw(st.integers(1, 30)),
            n=draw(st.sampled_from([1, 1, 1, 2])),
            # tokens of the tiny model's vocabulary: some runs stop on them
            stop_token_ids=draw(st.lists(st.integers(2, 511), max_size=3)),
            ignore_eos=draw(st.booleans()),
        )
        items.append((prompt[:32], params, draw(st.integers(0, 2))))
    return items


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(
    reqs=workloads(),
    scheduler=st.sampled_from(
        [
            {"name": "continuous"},
            {"name": "continuous", "admission": "reserve"},
            {"name": "chunked", "chunk_size": 8},
            {"name": "static"},
        ]
    ),
    allocator=st.sampled_from(
        [
            {"name": "paged", "block_size": 1},
            {"name": "paged", "block_size": 4, "prefix_caching": True},
            {"name": "paged", "block_size": 16, "prefix_caching": True},
            {"name": "contiguous"},
        ]
    ),
    preemption=st.sampled_from(["recompute", "swap"]),
    kv_tokens=st.sampled_from([MAX_MODEL_LEN, 96, 2048]),
    arrive=st.dictionaries(st.integers(0, 8), st.integers(0, 20), max_size=4),
    abort=st.dictionaries(st.integers(0, 8), st.integers(0, 25), max_size=2),
)
def test_fast_path_changes_nothing(
    reqs, scheduler, allocator, preemption, kv_tokens, arrive, abort
):
    if allocator["name"] == "contiguous":
        kv_tokens = max(kv_tokens, 4 * MAX_MODEL_LEN)  # slots of max_model_len each
    engine = dict(
        scheduler=scheduler,
        allocator=allocator,
        preemption=preemption,
        kv_cache_memory=kv_tokens * KIB // 2,
        swap_space=64 * KIB,
        max_num_seqs=6,
        max_num_batched_tokens=24 if scheduler["name"] == "chunked" else MAX_MODEL_LEN,
    )
    fast = run(True, reqs, engine, arrive, abort)
    slow = run(False, reqs, engine, arrive, abort)
    assert fast[0] == slow[0], "outputs differ"
    for i, (a, b) in enumerate(zip(fast[1], slow[1])):
        assert a == b, f"step {i} differs"
    assert len(fast[1]) == len(slow[1])
    assert slow[2] == 0  # the general path never hands out a decode batch


def test_steady_decoding_runs_as_a_batch():
    """Eight requests decoding side by side: after the prefill step and the
    step that builds the batch, every step until the first finish is a batch
    step, and a finish or an admission keeps the batch (rows leave, rows join)."""
    reqs = [
        ([5 + i] * (3 + i), SamplingParams(temperature=0.0, max_tokens=20 + i, ignore_eos=True), 0)
        for i in range(8)
    ]
    engine = dict(max_num_seqs=8, kv_cache_memory="1MiB")
    arrive = {7: 5}  # one request joins mid-run
    outputs, records, fast_steps = run(True, reqs, engine, arrive, {})
    assert all(out[0][0][1] == "length" for out in outputs.values())
    # only the first step (every prompt's prefill) takes the general path: the
    # late request is admitted inside a batch step and joins the batch after
    # its prefill; finished rows leave it
    assert len(records) - fast_steps == 1, (fast_steps, len(records))


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_batch_rows_mirror_the_allocator_every_step(block_size):
    """Block boundaries at every token (1), odd ones (3), and rarely (16):
    after every step the batch's tables and positions equal the sequences'."""
    reqs = [
        ([7] * (2 + 3 * i), SamplingParams(temperature=0.0, max_tokens=25, ignore_eos=True), 0)
        for i in range(5)
    ]
    engine = dict(allocator={"name": "paged", "block_size": block_size}, kv_cache_memory="1MiB")
    outputs, records, fast_steps = run(True, reqs, engine, {}, {})
    assert fast_steps > 15


def test_default_allocator_hooks_give_the_same_run(monkeypatch):
    """An allocator that does not override `extend_decodes` / `commit_decodes`
    (a third-party one) gets the contract's generic versions: the same run,
    step for step, as the general path."""
    from servelab.contracts.allocator import KVAllocator
    from servelab.plugins.allocators.paged import PagedAllocator

    monkeypatch.setattr(PagedAllocator, "extend_decodes", KVAllocator.extend_decodes)
    monkeypatch.setattr(PagedAllocator, "commit_decodes", KVAllocator.commit_decodes)
    reqs = [
        (
            SHARED + [20 + i] * (1 + 4 * i),
            SamplingParams(temperature=0.0, max_tokens=12 + 3 * i, ignore_eos=True),
            0,
        )
        for i in range(6)
    ]
    engine = dict(
        allocator={"name": "paged", "block_size": 4, "prefix_caching": True},
        kv_cache_memory=40 * KIB,  # 80 tokens: decodes preempt each other
        max_num_seqs=6,
    )
    fast = run(True, reqs, engine, {5: 3}, {})
    slow = run(False, reqs, engine, {5: 3}, {})
    assert fast[0] == slow[0] and fast[1] == slow[1]
    assert fast[2] > 10  # the generic hooks really served batch steps
    assert any(r["preempted"] for r in fast[1])  # and the general path took over when short
