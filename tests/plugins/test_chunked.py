"""Chunked prefill: prompts span steps, decodes never wait behind a whole
prompt, and chunking composes with preemption and prefix caching without
changing a token."""

from __future__ import annotations

import pytest

from servelab import LLM, SamplingParams
from servelab.engine.summary import decode_stalls

KIB = 1024  # float64 tiny model: 1 KiB of K/V per token
LONG = 600


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def interference(scheduler: dict, budget: int):
    """8 sequences decode; after 3 steps a long prompt arrives."""
    llm = LLM(
        model="tiny",
        dtype="float64",
        max_model_len=1024,
        kv_cache_memory=4096 * KIB,
        scheduler=scheduler,
        max_num_batched_tokens=budget,
    )
    eng = llm.engine
    for i in range(8):
        eng.add_request([10 + i] * 8, greedy(40), request_id=f"d{i}")
    outs = {}
    for step in range(500):
        if step == 3:
            eng.add_request([3 + i % 500 for i in range(LONG)], greedy(4), request_id="long")
        for out in eng.step():
            outs[out.request_id] = out
        if not eng.has_unfinished():
            break
    return eng, outs


def test_chunked_bounds_the_decode_stall_that_continuous_suffers():
    chunk, budget = 64, 96
    chunked, chunked_outs = interference({"name": "chunked", "chunk_size": chunk}, budget)
    whole, whole_outs = interference({"name": "continuous"}, 1024)
    assert {k: v.token_ids for k, v in chunked_outs.items()} == {
        k: v.token_ids for k, v in whole_outs.items()
    }
    prompt_steps = [s for s in chunked.metrics.steps if s.prefill_tokens > 0 and s.step > 3]
    assert len(prompt_steps) >= LONG // chunk  # the long prompt really spans steps
    assert all(s.decode_tokens == 8 for s in prompt_steps)  # decodes ran in every one of them
    stall_chunked = decode_stalls(chunked.metrics.requests, chunked.metrics.steps)
    stall_whole = decode_stalls(whole.metrics.requests, whole.metrics.steps)
    # in steps, decodes never skip one (they are scheduled first); in work, a
    # chunked gap holds at most one budget of prompt tokens, a whole one the prompt
    assert stall_chunked.steps == 1
    assert stall_chunked.prefill_tokens <= budget - 8
    assert stall_whole.prefill_tokens >= LONG
    assert stall_whole.prefill_tokens > stall_chunked.prefill_tokens


def test_first_token_is_sampled_only_with_the_last_prompt_chunk():
    llm = LLM(
        model="tiny",
        dtype="float64",
        max_model_len=128,
        scheduler={"name": "chunked", "chunk_size": 5},
        max_num_batched_tokens=5,
    )
    eng = llm.engine
    eng.add_request(list(range(3, 26)), greedy(3), request_id="p")  # 23 tokens: 5 chunks
    token_counts = []
    while eng.has_unfinished():
        eng.step()
        group = eng.groups.get("p")
        token_counts.append(group.seqs[0].num_output_tokens if group else 3)
    assert token_counts[:5] == [0, 0, 0, 0, 1]
    steps = eng.metrics.steps
    assert [s.prefill_tokens for s in steps[:5]] == [5, 5, 5, 5, 3]


@pytest.mark.parametrize("policy", ["recompute", "swap"])
def test_preempted_half_prefilled_sequence_restarts_correctly(policy):
    def run(**memory):
        llm = LLM(
            model="tiny",
            dtype="float64",
            max_model_len=64,
            swap_space=512 * KIB,
            scheduler={"name": "chunked", "chunk_size": 6},
            max_num_batched_tokens=14,
            allocator={"name": "paged", "block_size": 4},
            preemption=policy,
            **memory,
        )
        eng = llm.engine
        half_prefilled = []
        original = eng.scheduler._preempt  # spies on the core's preemption

        def spy(group, plan):
            half_prefilled.extend(
                s for s in group.unfinished() if 0 < s.num_computed_tokens < s.num_prompt_tokens
            )
            original(group, plan)

        eng.scheduler._preempt = spy
        for i in range(5):
            eng.add_request([20 + i] * (30 + i), greedy(12), request_id=f"r{i}", priority=i % 2)
        outs = {}
        while eng.has_unfinished():
            for out in eng.step():
                outs[out.request_id] = out
            eng.allocator.check_integrity()
            eng.scheduler.check_integrity()
        return {k: v.token_ids for k, v in outs.items()}, half_prefilled

    tight, half = run(kv_cache_memory=64 * KIB)
    ample, none = run(kv_cache_memory=2048 * KIB)
    assert half, "no sequence was preempted mid-prefill: the test would prove nothing"
    assert not none
    assert tight == ample


def test_chunks_start_after_the_cached_prefix():
    llm = LLM(
        model="tiny",
        dtype="float64",
        max_model_len=128,
        max_num_seqs=1,
        scheduler={"name": "chunked", "chunk_size": 8},
        max_num_batched_tokens=8,
        allocator={"name": "paged", "block_size": 4, "prefix_caching": True},
    )
    eng = llm.engine
    shared = list(range(40, 72))  # 32 tokens, 8 full blocks
    starts = []
    original = eng.scheduler.schedule

    def spy():
        plan = original()
        starts.extend((s.request_id, start, count) for s, start, count, _ in plan.rows())
        return plan

    eng.scheduler.schedule = spy
    outs = {}
    eng.add_request(shared + [1, 2, 3], greedy(2), request_id="a")
    eng.add_request(shared + [4, 5, 6, 7, 8, 9], greedy(2), request_id="b")
    while eng.has_unfinished():
        for out in eng.step():
            outs[out.request_id] = out
    b_chunks = [(start, n) for rid, start, n in starts if rid == "b"]
    assert b_chunks[0] == (32, 6)  # straight after the 32 cached tokens
    plain = LLM(model="tiny", dtype="float64", max_model_len=128)
    expected = plain.generate([shared + [1, 2, 3], shared + [4, 5, 6, 7, 8, 9]], greedy(2))
    assert [outs["a"].token_ids, outs["b"].token_ids] == [e.token_ids for e in expected]
