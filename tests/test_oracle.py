"""Every registered combination of parts produces exactly transformers' greedy
tokens (float64, CPU), under a KV budget tight enough to preempt.

flash_varlen's `cpu` impl must really run its C++ decode kernel here (it
serves float64), not a fallback: a hook captures each run's engine and its
backend's counter is checked. The model's C++ matmuls (`engine.cpu_kernels`,
on by default wherever they build) serve every combination too; the torch
path they replace is held to the same tokens for each architecture."""

from __future__ import annotations

import pytest

from servelab import hookimpl
from servelab.kernels import cpu_linear, cpu_paged
from servelab.registry.plugin_manager import get_plugin_manager
from servelab.testing.oracle import (
    assert_matches_reference,
    combinations,
    combo_id,
    drive,
    make_case,
)

# The attention backends run the full matrix against the parts they were built
# with (CORE). Every other registered part (newer built-ins, plugins) runs in
# every combination of schedulers, allocators and preemption policies under one
# backend, per_request: a new part adds its own rows instead of multiplying the
# matrix by the number of backends.
CORE = {
    "scheduler": {"static", "continuous", "chunked"},
    "allocator": {"contiguous", "paged"},
    "preemption": {"recompute", "swap"},
}
ONE_BACKEND = "per_request"


def is_core(combo: dict) -> bool:
    return all(
        combo[kind]["name"] in names and "order" not in combo[kind] for kind, names in CORE.items()
    )


ALL = [c for c in combinations() if is_core(c) or c["attention"]["name"] == ONE_BACKEND]


class EngineSpy:
    """A runtime plugin keeping the engine of the latest run."""

    engine = None

    @hookimpl
    def servelab_engine_ready(self, engine) -> None:
        self.engine = engine


@pytest.fixture(scope="module", autouse=True)
def spy():
    manager = get_plugin_manager()
    watcher = EngineSpy()
    manager.register(watcher, name="test-oracle-engine-spy")
    yield watcher
    manager.unregister(watcher)


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    made = {}

    def get(arch: str):
        if arch not in made:
            made[arch] = make_case(arch, tmp_path_factory.mktemp(arch))
        return made[arch]

    return get


def check(case, combo, spy, **engine):
    run = drive(case, combo, **engine)
    assert_matches_reference(case, combo, run)
    assert run.tokens == case.expected
    kernels_expected = (
        engine.get("cpu_kernels", "auto") != "off" and cpu_linear.kernel() is not None
    )
    assert spy.engine.executor.runner.cpu_kernels == kernels_expected, (
        f"[{combo_id(combo)}] cpu_kernels"
    )
    attention = combo["attention"]
    if attention["name"] == "flash_varlen":
        calls = spy.engine.backend.stats()["cpu_kernel_calls"]
        if attention["impl"] == "cpu" and cpu_paged.kernel() is not None:
            assert calls > 0, f"[{combo_id(combo)}] the C++ decode kernel never ran"
        else:
            assert calls == 0, f"[{combo_id(combo)}] the C++ decode kernel ran"
    on_demand = combo["scheduler"].get("admission", "on_demand") == "on_demand"
    allocator = combo["allocator"]
    blocky = allocator["name"] == "paged" or allocator.get("page_size", 1) > 1
    if on_demand and blocky:
        # the budget is tight enough that the preemption policy really runs for
        # block-granular layouts (contiguous takes a whole max_model_len slot at
        # admission: it never grows; radix with one-token pages wastes no slot and
        # fits the continuous schedulers' runs)
        assert run.preempted > 0, f"[{combo_id(combo)}] nothing was preempted"


@pytest.mark.parametrize("combo", ALL, ids=combo_id)
def test_qwen3_every_combination(cases, combo, spy):
    check(cases("qwen3"), combo, spy)


# Qwen2 and Llama differ from Qwen3 only inside the model: every scheduler x
# allocator x attention combination, with one preemption policy
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize(
    "combo", [c for c in ALL if is_core(c) and c["preemption"]["name"] == "recompute"], ids=combo_id
)
def test_other_architectures(cases, arch, combo, spy):
    check(cases(arch), combo, spy)


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
def test_torch_matmuls_without_cpu_kernels(cases, arch, spy):
    """`engine.cpu_kernels=off`: the model's own F.linear path, same tokens."""
    combo = next(c for c in ALL if c["preemption"]["name"] == "recompute")
    check(cases(arch), combo, spy, cpu_kernels="off")
