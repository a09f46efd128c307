"""Seeded sampling through the engine, with each way of making seeded noise: a
request's tokens equal the same request run alone, in any batch and under
preemption (recompute and swap)."""

from __future__ import annotations

import pytest

import servelab.plugins.executors.model as model_executor
from servelab import LLM, SamplingParams
from servelab.model.sampler import Sampler

KIB = 1024  # the float64 tiny model stores 1 KiB of K/V per token
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=14, seed=11, ignore_eos=True)
OTHERS = SamplingParams(temperature=1.1, max_tokens=14, ignore_eos=True)
PROMPTS = [[20 + i] * (10 + 3 * i) for i in range(4)]


def tiny(noise: str, monkeypatch, **kwargs) -> LLM:
    monkeypatch.setattr(model_executor, "Sampler", lambda: Sampler(noise))
    options = dict(model="tiny", dtype="float64", max_model_len=64, swap_space=256 * KIB)
    return LLM(**{**options, **kwargs})


@pytest.mark.parametrize("noise", ["generator", "counter"])
def test_seeded_tokens_ignore_batch_and_preemption(noise, monkeypatch):
    alone = tiny(noise, monkeypatch).generate([PROMPTS[3]], SEEDED)[0].token_ids
    params = [OTHERS, SEEDED, OTHERS, SEEDED]
    prompts = [PROMPTS[0], PROMPTS[3], PROMPTS[1], PROMPTS[3]]
    for policy in ("recompute", "swap"):
        llm = tiny(
            noise,
            monkeypatch,
            preemption=policy,
            kv_cache_memory=64 * KIB,
            allocator={"name": "paged", "block_size": 4},
        )
        outs = llm.generate(prompts, params)
        stats = llm.engine.scheduler.stats()
        assert stats[f"preemptions_{policy}"] > 0, "the batch was meant to preempt"
        assert outs[1].token_ids == alone and outs[3].token_ids == alone
    other = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=14, seed=12, ignore_eos=True)
    assert tiny(noise, monkeypatch).generate([PROMPTS[3]], other)[0].token_ids != alone
