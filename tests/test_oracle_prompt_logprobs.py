"""Prompt logprobs (`SamplingParams.prompt_logprobs`, what the completions API's echo
with logprobs returns) equal transformers' float64 log-softmax of the prompt's logits:
one entry per prompt token, None for the first (nothing precedes it), the token's
logprob and the top k, through whole-prompt, chunked and preempted prefills and with
prefix caching on (a request asking for them reads no cached prefix: every position
is computed, as vLLM does); the generated tokens stay the reference's."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from servelab import LLM, SamplingParams
from servelab.testing.hf_reference import build_tiny_hf
from servelab.testing.oracle import (
    ENGINE_OPTIONS,
    assert_matches_reference,
    cached_case,
    combo_id,
    drive,
    restored_num_threads,
)
from servelab.testing.oracle_sampling import PATH_COMBOS

COMBOS = [
    *PATH_COMBOS,
    {"scheduler": {"name": "chunked", "admission": "on_demand", "chunk_size": 8},
     "allocator": {"name": "radix", "page_size": 4}, "preemption": {"name": "recompute"},
     "attention": {"name": "per_request"}},
]  # fmt: skip
TOP = [3, 0, None]  # prompt_logprobs per prompt, in turn (None: not asked for)


@pytest.fixture(scope="module")
def case():
    base = cached_case("qwen3")
    params = [dataclasses.replace(p, prompt_logprobs=TOP[i % 3])
              for i, p in enumerate(base.params)]  # fmt: skip
    return dataclasses.replace(base, params=params)


@pytest.fixture(scope="module")
def reference(case):
    """transformers' float64 log-softmax over each prompt's logits (one forward each)."""
    with restored_num_threads(1), torch.no_grad():
        model = build_tiny_hf("qwen3", 0, num_kv_heads=2)
        return [model(torch.tensor([p])).logits[0].double().log_softmax(-1) for p in case.prompts]


def assert_prompt_logprobs(case, reference, got) -> None:
    for i, (prompt, params, entries) in enumerate(zip(case.prompts, case.params, got)):
        if params.prompt_logprobs is None:
            assert entries is None
            continue
        assert len(entries) == len(prompt) and entries[0] is None, i
        k = params.prompt_logprobs
        for j, entry in enumerate(entries[1:], start=1):
            row = reference[i][j - 1]  # position j - 1 predicts token j
            assert entry["token_id"] == prompt[j]
            assert entry["logprob"] == pytest.approx(row[prompt[j]].item(), abs=1e-5), (i, j)
            values, ids = row.topk(k) if k else (row[:0], row[:0].long())
            assert [t for t, _ in entry["top"]] == ids.tolist(), (i, j)
            assert [lp for _, lp in entry["top"]] == pytest.approx(values.tolist(), abs=1e-5)


@pytest.mark.parametrize("combo", COMBOS, ids=combo_id)
def test_prompt_logprobs_match_transformers(case, reference, combo):
    run = drive(case, combo)
    assert_matches_reference(case, combo, run)  # the tokens are the reference's
    assert_prompt_logprobs(case, reference, run.prompt_logprobs)


def test_a_cached_prefix_is_not_used_for_prompt_logprobs(case, reference):
    """The second pass finds every prompt in the prefix cache, and still scores it whole."""
    llm = LLM(model=str(case.folder), **COMBOS[1], **ENGINE_OPTIONS)
    plain = [dataclasses.replace(p, prompt_logprobs=None) for p in case.params]
    llm.generate(case.prompts, plain)
    hits = llm.engine.allocator.usage()["prefix_hit_tokens"]
    assert hits > 0  # the prompts share prefixes: the cache serves some
    outs = llm.generate(case.prompts, case.params)
    assert [o.token_ids for o in outs] == case.expected
    assert_prompt_logprobs(case, reference, [o.prompt_logprobs for o in outs])
    plain_again = llm.generate(case.prompts, plain)
    assert llm.engine.allocator.usage()["prefix_hit_tokens"] > hits  # the cache still serves
    assert [o.token_ids for o in plain_again] == case.expected


def test_the_simulated_executor_gives_stand_ins():
    llm = LLM(model="tiny", executor="simulated", max_model_len=64)
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=2, prompt_logprobs=2))[0]
    vocab = llm.engine.model_config.vocab_size
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == 4
    assert [e["token_id"] for e in out.prompt_logprobs[1:]] == [6, 7, 8]
    assert all(e["logprob"] == pytest.approx(-torch.log(torch.tensor(float(vocab))).item())
               and len(e["top"]) == 2 for e in out.prompt_logprobs[1:])  # fmt: skip
