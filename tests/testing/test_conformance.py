"""The conformance kit (`servelab.testing`): it passes every built-in part,
and it catches deliberately broken ones with a clear AssertionError."""

from __future__ import annotations

import pytest

from servelab.contracts.scheduler import SchedulingPolicy
from servelab.plugins.allocators.paged import PagedAllocator
from servelab.plugins.attention.per_request import PerRequestBackend
from servelab.plugins.preemption.recompute import RecomputePolicy
from servelab.registry.plugin_manager import get_plugin_manager, registered
from servelab.testing import (
    check_allocator,
    check_attention_backend,
    check_preemption,
    check_scheduler,
    temporarily_registered,
)
from servelab.testing.deps import require

CHECKS = {
    "scheduler": check_scheduler,
    "allocator": check_allocator,
    "preemption": check_preemption,
    "attention": check_attention_backend,
}
# every built-in, in the options its oracle variants use (triton_paged: tests/plugins/test_triton_kernels.py)
BUILTINS = [
    ("scheduler", "continuous", {}),
    ("scheduler", "chunked", {"chunk_size": 8}),
    ("scheduler", "static", {"admission": "reserve"}),
    ("scheduler", "continuous", {"order": "lpm"}),
    ("scheduler", "vtc", {}),
    ("scheduler", "mlfq", {"base_quantum": 2, "prompt_tokens_per_step": 8, "starvation_steps": 16}),
    ("allocator", "paged", {"block_size": 4}),
    ("allocator", "paged", {"block_size": 4, "prefix_caching": True}),
    ("allocator", "contiguous", {}),
    ("allocator", "radix", {}),
    ("allocator", "radix", {"page_size": 4}),
    ("preemption", "recompute", {}),
    ("preemption", "swap", {}),
    ("preemption", "hybrid", {"break_even_tokens": 16}),
    ("attention", "per_request", {}),
    ("attention", "padded", {}),
    ("attention", "flash_varlen", {"impl": "reference"}),
]


@pytest.mark.parametrize("kind,name,options", BUILTINS, ids=lambda x: str(x))
def test_kit_passes_builtin(kind, name, options):
    report = CHECKS[kind](registered(kind)[name].cls, **options)
    assert report.combinations and not report.skipped
    if kind == "scheduler" and options.get("admission", "on_demand") == "on_demand":
        assert report.preempted > 0, "the kit's tight budget should force preemption"


def test_part_is_unregistered_after_a_check_even_when_it_fails():
    before = set(registered("scheduler"))
    with pytest.raises(AssertionError):
        check_scheduler(StarvesARequest)
    assert set(registered("scheduler")) == before
    assert not [n for n in get_plugin_manager().list_name_plugin() if "servelab.testing" in n[0]]


# -- deliberately broken parts


class StarvesARequest(SchedulingPolicy):
    """Never offers the third request it hears of for admission: it waits for ever."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.added: list[str] = []

    def on_add(self, group) -> None:
        self.added.append(group.request_id)

    def admission_order(self, candidates, plan):
        starved = self.added[2:3]
        return [g for g in super().admission_order(candidates, plan) if g.request_id not in starved]


class LeaksABlock(PagedAllocator):
    """Never frees the first sequence that finishes; every invariant holds, the blocks are lost."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.leaked: int | None = None

    def free(self, seq) -> None:
        if self.leaked is None and seq.is_finished and seq.seq_id in self.tables:
            self.leaked = seq.seq_id
        if seq.seq_id != self.leaked:
            super().free(seq)


class WrongScale(PerRequestBackend):
    """Scales scores by 1/head_dim instead of 1/sqrt(head_dim): a classic attention bug."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, 1.0 / head_dim)


class PicksAStranger(RecomputePolicy):
    """Returns a copy of a running group instead of the group itself."""

    def select_victim(self, running):
        return list(running[0])


class NotAPolicy:  # answers a hook, but is no SchedulingPolicy
    def admission_order(self, candidates, plan):
        return candidates


def test_kit_catches_a_scheduler_that_starves_a_request():
    with pytest.raises(AssertionError, match=r"no end after \d+ steps; unfinished requests"):
        check_scheduler(StarvesARequest)


def test_kit_catches_an_allocator_that_leaks_a_block():
    # the state machine frees sequences that never finish: the engine runs catch this leak
    with pytest.raises(AssertionError, match=r"device blocks leaked"):
        check_allocator(LeaksABlock, block_size=4)


def test_kit_catches_a_backend_that_gets_attention_wrong():
    with pytest.raises(
        AssertionError, match=r"servelab produced .* transformers .* first difference"
    ):
        check_attention_backend(WrongScale)


def test_kit_catches_a_victim_that_is_not_a_candidate():
    with pytest.raises(AssertionError, match=r"none of the groups it was offered"):
        check_preemption(PicksAStranger)


def test_kit_names_the_contract_a_part_does_not_subclass():
    with pytest.raises(AssertionError, match=r"not a valid scheduler.*SchedulingPolicy"):
        check_scheduler(NotAPolicy)


def test_registration_is_temporary():
    with temporarily_registered("attention", PerRequestBackend) as name:
        assert registered("attention")[name].cls is PerRequestBackend
    assert name not in registered("attention")


def test_missing_optional_dependency_names_the_dev_extra():
    with pytest.raises(
        ImportError, match=r"servelab_no_such_module.*pip install 'servelab\[dev\]'"
    ):
        require("servelab_no_such_module", "a test")
