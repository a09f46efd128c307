"""Speculative decoding changes when tokens are computed, never which: every
proposer, on every combination the oracle runs, gives exactly transformers'
greedy tokens (and so those of `proposer=none`), with the allocator's integrity
checked after every step and every block free at the end.

`reference` (drafts the true outputs, wrong at random positions: long accepted
runs ending at EOS, at a stop token or at max_tokens inside a run, across block
boundaries, under preemption) runs the whole matrix, every attention backend
included: what reaches a backend is a row of 1 + drafts tokens, whoever drafted
them. The built-ins run every scheduler x allocator x preemption combination
(with one backend, as newer parts do in tests/test_oracle.py): `ngram` (on the
oracle's random prompts its drafts are mostly rejected, at every position),
`draft` (a second tiny model drafts, with its own KV cache) and `eagle` (a
random EAGLE head over the target's hidden states)."""

from __future__ import annotations

import pytest
import torch

from servelab.testing.hf_reference import build_tiny_hf
from servelab.testing.oracle import (
    assert_matches_reference,
    combo_id,
    drive,
    engine_options,
    make_case,
)
from servelab.testing.proposers import write_random_eagle_head
from tests.test_oracle import ALL, ONE_BACKEND

pytestmark = pytest.mark.usefixtures("test_proposers")


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    made = make_case("qwen3", tmp_path_factory.mktemp("qwen3"))
    # another tiny model over the same vocabulary drafts for it (mostly wrong)
    made.draft_folder = make_case("qwen3", tmp_path_factory.mktemp("draft"), seed=1).folder
    # a random EAGLE head over it (mostly wrong drafts; every step of the head runs)
    made.eagle_folder = write_random_eagle_head(made.folder, tmp_path_factory.mktemp("eagle"))
    return made


def proposers(case) -> dict[str, dict]:
    return {
        "draft": {
            "name": "draft",
            "model": str(case.draft_folder),
            "k": 3,
            "kv_cache_memory": 64 * 1024,
        },
        "eagle": {"name": "eagle", "model": str(case.eagle_folder), "k": 3},
        "ngram": {"name": "ngram", "k": 3, "min_n": 1, "max_n": 2},
        "reference": {
            "name": "reference",
            "k": 5,
            "prompts": case.prompts,
            "outputs": case.expected,
            "wrong": 0.2,
        },
    }


def check(case, combo, proposer: str, **engine):
    node = proposers(case)[proposer]
    run = drive(case, {**combo, "proposer": node}, **engine)
    assert_matches_reference(case, {**combo, "proposer": {"name": proposer}}, run)
    stats = run.scheduler_stats
    assert stats["spec_num_drafts"] > 0, f"[{combo_id(combo)}] {proposer}: nothing was verified"
    if proposer == "reference":
        # drafts of the true tokens: most are kept, several whole runs of them
        assert stats["spec_num_accepted_tokens"] > stats["spec_num_draft_tokens"] // 3
    return run


@pytest.mark.parametrize("combo", ALL, ids=combo_id)
def test_every_combination_with_drafts(case, combo):
    check(case, combo, "reference")


@pytest.mark.parametrize("proposer", ["ngram", "draft", "eagle"])
@pytest.mark.parametrize("combo", [c for c in ALL if c["attention"]["name"] == ONE_BACKEND],
                         ids=combo_id)  # fmt: skip
def test_every_built_in_proposer(case, combo, proposer):
    check(case, combo, proposer)


def test_a_draft_model_equal_to_the_target_is_always_right(case):
    """The target drafting for itself: every draft is kept, and the run ends in
    about (k + 1) times fewer decode steps."""
    combo = {"scheduler": {"name": "continuous"}, "allocator": {"name": "paged", "block_size": 4},
             "preemption": {"name": "recompute"}, "attention": {"name": "per_request"}}  # fmt: skip
    node = {"name": "draft", "model": str(case.folder), "k": 3, "kv_cache_memory": 1 << 20}
    run = drive(case, {**combo, "proposer": node}, kv_cache_memory=1 << 20)
    assert_matches_reference(case, combo, run)
    stats = run.scheduler_stats
    assert stats["spec_num_accepted_tokens"] == stats["spec_num_draft_tokens"] > 0


@pytest.mark.parametrize(
    "allocator",
    [
        {"name": "paged", "block_size": 4},
        {"name": "paged", "block_size": 4, "prefix_caching": True},
    ],
)
def test_the_hidden_states_a_proposer_reads_are_the_targets(case, allocator):
    """What `on_hidden_states` hands a proposer (EAGLE's features) equals
    transformers' final hidden states of the same tokens, position by position,
    with chunked prefill, preemption and verification (kept positions only)."""
    from servelab import LLM

    combo = {"scheduler": {"name": "chunked", "chunk_size": 8, "admission": "on_demand"},
             "allocator": allocator,
             "preemption": {"name": "recompute"}, "attention": {"name": "per_request"}}  # fmt: skip
    llm = LLM(model=str(case.folder), proposer={"name": "recording", "k": 2}, **combo,
              **engine_options(combo, kv_cache_memory=96 * 1024))  # fmt: skip
    outputs = llm.generate(case.prompts, case.params)
    recorded = llm.engine.scheduler.speculation.proposer.features
    stats = llm.engine.scheduler.stats()
    assert stats["spec_num_drafts"] > 0 and stats["preemptions_recompute"] > 0
    reference = build_tiny_hf("qwen3", 0)
    for out in outputs:
        tokens = out.prompt_token_ids + out.token_ids
        with torch.no_grad():
            want = reference.model(torch.tensor([tokens[:-1]])).last_hidden_state[0]
        # the sequence whose recorded positions lie within this request's tokens and match
        matches = [
            f for f in recorded.values()
            if f and max(f) < len(tokens) - 1
            and all(torch.allclose(v, want[p], rtol=0, atol=1e-9) for p, v in f.items())
        ]  # fmt: skip
        assert matches, f"request {out.request_id}: no recorded features equal transformers'"


@pytest.mark.parametrize("proposer", ["ngram", "reference", "draft", "eagle"])
def test_parallel_samples(case, proposer):
    """n = 3 greedy samples: each the reference; forks share blocks (copy-on-write)."""
    combo = {"scheduler": {"name": "continuous"}, "allocator": {"name": "paged", "block_size": 4},
             "preemption": {"name": "recompute"}, "attention": {"name": "per_request"}}  # fmt: skip
    run = drive(case, {**combo, "proposer": proposers(case)[proposer]}, n=3)
    assert_matches_reference(case, combo, run)


def test_the_eagle_head_drafts_the_same_for_requests_together_or_alone(case):
    """The head drafts for all requests in one batched pass per draft position;
    each request's drafts equal those it gets drafting alone, over two rounds
    (the second after the target kept some tokens: the head drops its predicted
    positions and catches up from true features), with different draft caps and
    one request the head has no features for."""
    import json

    from servelab.contracts.proposer import DraftRequest
    from servelab.plugins.proposers.eagle import EagleProposer

    config = json.loads((case.folder / "config.json").read_text())
    vocab, hidden = config["vocab_size"], config["hidden_size"]
    g = torch.Generator().manual_seed(0)
    tokens = {i: torch.randint(0, vocab, (5 + 3 * i,), generator=g).tolist() for i in range(4)}
    features = {i: torch.randn(64, hidden, generator=g) for i in range(4)}
    caps = {0: 3, 1: 1, 2: 2, 3: 3}

    def made() -> EagleProposer:
        return EagleProposer(model=str(case.eagle_folder), k=3, vocab_size=vocab)

    together, alone = made(), made()
    fed = {i: 0 for i in range(3)}  # request 3 never gets features: no drafts
    for round_ in range(2):
        for proposer in (together, alone):
            for i in fed:
                proposer.on_hidden_states(i, fed[i], features[i][fed[i] : len(tokens[i]) - 1])
        fed = {i: len(tokens[i]) - 1 for i in fed}
        requests = [DraftRequest(i, f"r{i}", list(tokens[i]), 4, caps[i]) for i in range(4)]
        got = together.propose(requests)
        want = [alone.propose([r])[0] for r in requests]
        assert got == want, round_
        assert [len(d) for d in got] == [3, 1, 2, 0]
        for i in range(4):  # the target kept two tokens of each
            tokens[i] += torch.randint(0, vocab, (2,), generator=g).tolist()
