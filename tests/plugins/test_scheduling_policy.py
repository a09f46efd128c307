"""The policy hooks (`servelab.contracts.scheduler`): a new scheduler in about
thirty lines passes the conformance kit, and the core refuses any answer that
would corrupt its block accounting."""

from __future__ import annotations

import pytest

from servelab.llm import LLM
from servelab.scheduling import HOOKS, SchedulerCore, SchedulingPolicy, SchedulingPolicyError
from servelab.step.sequence import SamplingParams
from servelab.testing.conformance import temporarily_registered


# -- a whole scheduler, written against the hooks only (it is the example in docs/plugins.md)
class ClientPriority(SchedulingPolicy):
    """Admits by client rank, then shortest prompt first.

    `clients`: comma-separated client names, highest rank first; any other
    client (and anonymous requests) comes after them. Within a rank, the
    shortest prompt goes first, then the earliest arrival. Admission stops at
    the first request that does not fit, so a long prompt is not overtaken
    for ever by shorter ones that would fit after it.
    """

    description = "priority by client, then shortest prompt"

    def __init__(self, clients: str = "", **kwargs) -> None:
        super().__init__(**kwargs)
        names = [c.strip() for c in clients.split(",") if c.strip()]
        self.rank = {name: i for i, name in enumerate(names)}

    def key(self, group):
        rank = self.rank.get(group.client, len(self.rank))
        return (rank, group.seqs[0].num_prompt_tokens, group.arrival_time, group.request_id)

    def admission_order(self, candidates, plan):
        return sorted(candidates, key=self.key)


def test_the_client_priority_policy_is_short():
    import inspect

    assert len(inspect.getsource(ClientPriority).splitlines()) <= 30


@pytest.mark.slow
def test_the_client_priority_policy_conforms():
    from servelab.testing import check_scheduler

    report = check_scheduler(ClientPriority, clients="client-1,client-0")
    assert report.preempted > 0


def engine(cls, **options):
    stack = temporarily_registered("scheduler", cls)
    name = stack.__enter__()
    llm = LLM(
        model="tiny",
        executor="simulated",
        scheduler={"name": name, **options},
        allocator={"name": "paged", "block_size": 4},
        max_model_len=64,
        max_num_batched_tokens=64,
        kv_cache_memory=64 * 1024,
    )
    return llm.engine, stack


def test_client_priority_admits_by_rank_then_shortest_prompt():
    eng, stack = engine(ClientPriority, clients="gold,silver")
    try:
        eng.scheduler.max_num_seqs = 1  # one at a time: the admission order is the finish order
        arrivals = [("a", None, 3), ("b", "silver", 9), ("c", "gold", 20), ("d", "silver", 2)]
        for rid, client, length in arrivals:
            eng.add_request([5] * length, SamplingParams(max_tokens=2), rid, client=client)
        done = []
        while eng.has_unfinished():
            done += [o.request_id for o in eng.step()]
    finally:
        stack.__exit__(None, None, None)
    assert done == ["c", "d", "b", "a"]


class AdmitsTwice(SchedulingPolicy):
    def admission_order(self, candidates, plan):
        return candidates[:1] * 2


class PicksAWaitingVictim(SchedulingPolicy):
    def pick_victims(self):
        return list(self.core.waiting)


class TooManyTokens(SchedulingPolicy):
    def tokens_for(self, seq, start, budget):
        return seq.num_tokens - start + 1


@pytest.mark.parametrize(
    "cls,hook",
    [
        (AdmitsTwice, "admission_order"),
        (PicksAWaitingVictim, "pick_victims"),
        (TooManyTokens, "tokens_for"),
    ],
)
def test_a_hook_cannot_corrupt_block_accounting(cls, hook):
    """The core refuses the answer before acting on it: the request fails with an
    error naming the hook, every block is free again, and the engine serves on."""
    eng, stack = engine(cls)
    try:
        eng.add_request([7] * 10, SamplingParams(max_tokens=3), "bad")
        with pytest.raises(SchedulingPolicyError, match=hook):
            eng.scheduler.schedule()
        eng.allocator.check_integrity()
        held = eng.allocator.num_blocks - eng.allocator.num_free_blocks
        # admitted once at most: the blocks of one 10-token prompt (3 of 4 tokens), or none
        assert held in (0, 3)
        eng.abort("bad")
        assert "bad" not in eng.groups
        assert eng.allocator.num_free_blocks == eng.allocator.num_blocks
        # through the engine: the step fails that request only, naming the hook
        eng.add_request([7] * 10, SamplingParams(max_tokens=3), "bad2")
        (failed,) = eng.step()
        assert failed.request_id == "bad2" and hook in failed.error
        assert eng.allocator.num_free_blocks == eng.allocator.num_blocks
        eng.allocator.check_integrity()
    finally:
        stack.__exit__(None, None, None)


def test_there_are_eight_hooks_and_each_has_a_default():
    assert len(HOOKS) == 8
    assert all(callable(getattr(SchedulingPolicy, h)) for h in HOOKS)


def test_a_policy_shows_the_hooks_alone():
    """What a policy author subclasses has no public method but the hooks; the
    engine-facing methods (`add`, `schedule`, `update`, ...) are the core's."""
    public = {
        name
        for name, value in vars(SchedulingPolicy).items()
        if callable(value) and not name.startswith("_")
    }
    assert public == set(HOOKS)
    engine_facing = {"add", "abort", "schedule", "update", "stats", "stop", "has_unfinished"}
    assert engine_facing <= {n for n in dir(SchedulerCore) if not n.startswith("_")}
    assert not engine_facing & set(dir(SchedulingPolicy))
