"""Every registered combination of parts produces exactly transformers' greedy
tokens (float64, CPU), under a KV budget tight enough to preempt."""

from __future__ import annotations

import pytest

from servelab.testing.oracle import assert_matches_reference, drive
from tests.oracle import combinations, combo_id, make_case

ALL = combinations()


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    made = {}

    def get(arch: str):
        if arch not in made:
            made[arch] = make_case(arch, tmp_path_factory.mktemp(arch))
        return made[arch]

    return get


def check(case, combo):
    run = drive(case, combo)
    assert_matches_reference(case, combo, run)
    assert run.tokens == case.expected
    on_demand = combo["scheduler"].get("admission", "on_demand") == "on_demand"
    if on_demand and combo["allocator"]["name"] == "paged":
        # the budget is tight enough that the preemption policy really runs
        # (contiguous takes a whole max_model_len slot at admission: it never grows)
        assert run.preempted > 0, f"[{combo_id(combo)}] nothing was preempted"


@pytest.mark.parametrize("combo", ALL, ids=combo_id)
def test_qwen3_every_combination(cases, combo):
    check(cases("qwen3"), combo)


# Qwen2 and Llama differ from Qwen3 only inside the model: every scheduler x
# allocator x attention combination, with one preemption policy
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize(
    "combo", [c for c in ALL if c["preemption"]["name"] == "recompute"], ids=combo_id
)
def test_other_architectures(cases, arch, combo):
    check(cases(arch), combo)
