"""Speculative decoding changes when tokens are computed, never which: every
proposer, on every combination the oracle runs, gives exactly transformers'
greedy tokens (and so those of `proposer=none`), with the allocator's integrity
checked after every step and every block free at the end.

Two proposers run the whole matrix: `ngram` (the built-in; on the oracle's
random prompts its drafts are mostly rejected, at every position) and
`reference` (drafts the true outputs, wrong at random positions: long accepted
runs ending at EOS, at a stop token or at max_tokens inside a run, across block
boundaries, under preemption)."""

from __future__ import annotations

import pytest

from servelab.registry.plugin_manager import get_plugin_manager
from servelab.testing.oracle import assert_matches_reference, combo_id, drive, make_case
from servelab.testing.proposers import TestProposers
from tests.test_oracle import ALL


@pytest.fixture(scope="module", autouse=True)
def test_proposers():
    manager = get_plugin_manager()
    plugin = TestProposers()
    manager.register(plugin, name="test-oracle-proposers")
    yield
    manager.unregister(plugin)


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    made = make_case("qwen3", tmp_path_factory.mktemp("qwen3"))
    # another tiny model over the same vocabulary drafts for it (mostly wrong)
    made.draft_folder = make_case("qwen3", tmp_path_factory.mktemp("draft"), seed=1).folder
    return made


def proposers(case) -> dict[str, dict]:
    return {
        "draft": {
            "name": "draft",
            "model": str(case.draft_folder),
            "k": 3,
            "kv_cache_memory": 64 * 1024,
        },  # fmt: skip
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


@pytest.mark.parametrize("proposer", ["ngram", "reference", "draft"])
@pytest.mark.parametrize("combo", ALL, ids=combo_id)
def test_every_combination_with_every_proposer(case, combo, proposer):
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


@pytest.mark.parametrize("proposer", ["ngram", "reference", "draft"])
def test_parallel_samples(case, proposer):
    """n = 3 greedy samples: each the reference; forks share blocks (copy-on-write)."""
    combo = {"scheduler": {"name": "continuous"}, "allocator": {"name": "paged", "block_size": 4},
             "preemption": {"name": "recompute"}, "attention": {"name": "per_request"}}  # fmt: skip
    run = drive(case, {**combo, "proposer": proposers(case)[proposer]}, n=3)
    assert_matches_reference(case, combo, run)
