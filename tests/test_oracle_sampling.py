"""Logits processing (repetition, frequency and presence penalties, min_tokens,
logit_bias) produces exactly transformers' greedy tokens with its own logits
processors (an independent loop for OpenAI's count penalties), through the
schedulers' prefill, chunked and decode-batch paths and under preemption; and a
seeded request with processing draws the same tokens alone and in a batch."""

from __future__ import annotations

import dataclasses

import pytest

from servelab import LLM
from servelab.testing.oracle import (
    ENGINE_OPTIONS,
    assert_matches_reference,
    cached_case,
    combo_id,
    drive,
)
from servelab.testing.oracle_sampling import PATH_COMBOS, processing_case, processing_params

COMBOS = [
    *PATH_COMBOS,
    {"scheduler": {"name": "static", "admission": "reserve"},
     "allocator": {"name": "contiguous"}, "preemption": {"name": "recompute"},
     "attention": {"name": "per_request"}},
]  # fmt: skip


@pytest.fixture(scope="module")
def case():
    return processing_case(cached_case("qwen3"))


def test_the_processing_changes_the_reference(case):
    plain = cached_case("qwen3")
    changed = [i for i, (a, b) in enumerate(zip(plain.expected, case.expected)) if a != b]
    assert len(changed) >= len(case.prompts) // 2, changed  # the cases test something


@pytest.mark.parametrize("combo", COMBOS, ids=combo_id)
def test_processing_matches_transformers(case, combo):
    run = drive(case, combo)
    assert_matches_reference(case, combo, run)


def test_seeded_processing_does_not_depend_on_the_batch():
    base = cached_case("qwen3")
    params = [dataclasses.replace(p, temperature=0.9, seed=100 + i, ignore_eos=True)
              for i, p in enumerate(processing_params(base))]  # fmt: skip
    llm = LLM(model=str(base.folder), **{**ENGINE_OPTIONS, "max_num_seqs": 8})
    together = [o.token_ids for o in llm.generate(base.prompts, params)]
    alone = [llm.generate([p], [sp])[0].token_ids for p, sp in zip(base.prompts, params)]
    assert together == alone
