"""Every registered combination of parts produces exactly transformers' greedy
tokens (float64, CPU), under a KV budget tight enough to preempt."""

from __future__ import annotations

import pytest

from tests.oracle import combinations, combo_id, make_case, run_engine

ALL = combinations()


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    made = {}

    def get(arch: str):
        if arch not in made:
            made[arch] = make_case(arch, tmp_path_factory.mktemp(arch))
        return made[arch]

    return get


@pytest.mark.parametrize("combo", ALL, ids=combo_id)
def test_qwen3_every_combination(cases, combo):
    case = cases("qwen3")
    assert run_engine(case, combo) == case.expected


# Qwen2 and Llama differ from Qwen3 only inside the model: every part once is enough
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize(
    "combo",
    [
        c
        for c in ALL
        if c["preemption"]["name"] == "recompute" and c["scheduler"]["name"] == "continuous"
    ],
    ids=combo_id,
)
def test_other_architectures(cases, arch, combo):
    case = cases(arch)
    assert run_engine(case, combo) == case.expected
