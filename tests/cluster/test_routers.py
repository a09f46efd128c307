"""The router kind: every built-in passes the conformance kit, the kit catches broken
routers, and each built-in makes the decision its rule says on hand-made states."""

from __future__ import annotations

import random

import pytest

from servelab.contracts.router import ReplicaState, RoutedRequest, Router
from servelab.registry.construct import construct
from servelab.registry.plugin_manager import registered
from servelab.testing import check_router

BUILTINS = ["round_robin", "least_load", "power_of_two", "prefix_affinity"]


@pytest.mark.parametrize("name", BUILTINS)
def test_kit_passes_builtin_router(name):
    report = check_router(registered("router")[name].cls)
    assert len(report.properties) == 4 and report.combinations


def test_every_builtin_is_listed():

    assert set(BUILTINS) <= set(registered("router"))
    assert construct("router", "round_robin", num_replicas=3).num_replicas == 3


def test_servelab_plugins_lists_the_router_kind(capsys):
    from servelab.registry.listing import main

    main(["router"])
    out = capsys.readouterr().out
    assert out.startswith("router:")
    for name in BUILTINS:
        assert f"  {name} " in out


class OutOfRange(Router):
    def route(self, request, replicas):
        return len(replicas)


class GlobalRandom(Router):
    def route(self, request, replicas):
        return random.randrange(len(replicas))  # unseeded: not repeatable


class Mutating(Router):
    def route(self, request, replicas):
        replicas.reverse()
        return 0


@pytest.mark.parametrize(
    "cls,message",
    [(OutOfRange, "for 1 replicas"), (GlobalRandom, "decided differently"), (Mutating, "changed")],
)
def test_kit_catches_a_broken_router(cls, message):
    with pytest.raises(AssertionError, match=message):
        check_router(cls)


def states(*loads: int) -> list[ReplicaState]:
    return [
        ReplicaState(index=i, running_requests=1, running_tokens=t) for i, t in enumerate(loads)
    ]


def request(n: int, prompt: list[int]) -> RoutedRequest:
    return RoutedRequest(f"r{n}", tuple(prompt), 8)


def test_round_robin_cycles():
    router = construct("router", "round_robin", num_replicas=3)
    assert [router.route(request(n, [1]), states(0, 0, 0)) for n in range(5)] == [0, 1, 2, 0, 1]


def test_least_load_picks_fewest_outstanding_tokens_ties_to_lower_index():
    router = construct("router", "least_load", num_replicas=3)
    assert router.route(request(0, [1]), states(50, 10, 30)) == 1
    assert router.route(request(1, [1]), states(10, 10, 30)) == 0


def test_power_of_two_picks_the_lighter_of_its_two_probes():
    router = construct("router", "power_of_two", num_replicas=4)
    probe = random.Random(0)  # the router's own generator, replayed
    loads = [40, 10, 30, 20]
    for n in range(20):
        a, b = probe.sample(range(4), 2)
        expected = a if (loads[a], a) <= (loads[b], b) else b
        assert router.route(request(n, [1]), states(*loads)) == expected


def test_prefix_affinity_follows_the_cached_prefix_then_load():
    router = construct(
        "router", {"name": "prefix_affinity", "block_size": 4, "min_saved_tokens": 16},
        num_replicas=3,
    )
    system = list(range(100, 116))  # four full blocks
    first = router.route(request(0, system + [1, 2]), states(0, 0, 0))
    assert first == 0  # nothing cached: least loaded, lowest index
    router.on_routed(request(0, system + [1, 2]), first)
    # the same system prompt goes where it is cached, though replica 0 is now busier
    assert router.route(request(1, system + [7, 8, 9]), states(30, 0, 0)) == 0
    # a prompt sharing under half of its tokens with the cache goes by load
    assert router.route(request(2, system[:4] + list(range(20))), states(30, 0, 5)) == 1


def test_prefix_affinity_gives_way_to_balance():
    router = construct(
        "router",
        {"name": "prefix_affinity", "block_size": 4, "balance_abs_tokens": 100, "balance_rel": 2.0,
         "min_saved_tokens": 0},
        num_replicas=2,
    )
    prompt = list(range(16))
    router.on_routed(request(0, prompt), 0)
    assert router.route(request(1, prompt), states(150, 60)) == 0  # 90 apart: affinity holds
    assert router.route(request(2, prompt), states(500, 60)) == 1  # 440 apart and > 2x: balance


def test_prefix_affinity_sends_to_a_busier_replica_only_what_its_cache_saves():
    """A busier replica than the least loaded gets a request for its cache only when the
    cache saves at least `min_saved_tokens` (default 256) prompt tokens more than the least
    loaded replica's: a shared 40-token system prompt (32 tokens in full 16-token blocks) is
    not worth waiting behind another request; a 320-token history is."""
    router = construct("router", "prefix_affinity", num_replicas=4)
    system = list(range(1000, 1040))
    first = request(0, system + list(range(12)))
    assert router.route(first, states(0, 0, 0, 0)) == 0
    router.on_routed(first, 0)
    # equal loads: the cached system prompt is free, so it still counts
    assert router.route(request(1, system + list(range(50, 62))), states(0, 0, 0, 0)) == 0
    # replica 0 busy, 32 cached tokens saved there: the idle replica 1 serves it
    assert router.route(request(2, system + list(range(50, 62))), states(64, 0, 0, 0)) == 1
    history = system + list(range(2000, 2280))  # 320 tokens: 20 full blocks
    router.on_routed(request(3, history), 2)
    follow_up = request(4, history + list(range(30)))
    # 320 tokens saved on replica 2, 32 at most elsewhere: 288 >= 256, affinity holds
    assert router.route(follow_up, states(0, 0, 400, 0)) == 2
    stricter = construct(
        "router", {"name": "prefix_affinity", "min_saved_tokens": 336}, num_replicas=4
    )
    stricter.on_routed(request(3, history), 2)
    assert stricter.route(follow_up, states(0, 0, 400, 0)) == 0  # 320 saved < 336: by load


def test_prefix_affinity_forgets_least_recently_routed_blocks():
    router = construct(
        "router", {"name": "prefix_affinity", "block_size": 4, "cache_blocks": 2}, num_replicas=2
    )
    router.on_routed(request(0, list(range(8))), 1)  # two blocks on replica 1
    router.on_routed(request(1, list(range(50, 58))), 1)  # two more: the first two are evicted
    assert router.route(request(2, list(range(8))), states(0, 0)) == 0  # no match left: by load


def test_bad_option_is_a_clear_error():
    from servelab.errors import ConfigError

    with pytest.raises(ConfigError, match="cache_threshold"):
        construct("router", {"name": "prefix_affinity", "cache_threshold": 2.0}, num_replicas=2)
    with pytest.raises(ConfigError, match="min_saved_tokens must be >= 0, got -1"):
        construct("router", {"name": "prefix_affinity", "min_saved_tokens": -1}, num_replicas=2)
    with pytest.raises(ConfigError, match="registered: least_load, power_of_two"):
        construct("router", "nearest", num_replicas=2)
