"""The one table of the kinds of part: every place that enumerates them (the
plugin manager, `construct`, the builder, the CLI, the conformance kit) reads it.

A kind names its contract (the ABC a part subclasses), the registration hook
that collects its parts, the context the engine passes to every part of the
kind (never a user option), and the built-in a config gets when it names none.
"""

from __future__ import annotations

from dataclasses import dataclass

from servelab.contracts.allocator import KVAllocator
from servelab.contracts.attention import AttentionBackend
from servelab.contracts.executor import Executor
from servelab.contracts.kv_tier import KVTier
from servelab.contracts.preemption import PreemptionPolicy
from servelab.contracts.proposer import Proposer
from servelab.contracts.router import Router
from servelab.contracts.scheduler import SchedulingPolicy
from servelab.errors import ConfigError


@dataclass(frozen=True)
class Kind:
    name: str  # the config group and the CLI's word: `scheduler=chunked`
    contract: type
    hook: str  # the registration hook, `servelab_register_*`
    context: frozenset[str]  # supplied by the engine: `cls(**options, **context)`
    default: str  # the built-in part used when a config names none
    in_engine: bool = True  # False: a part above the engine (the router), not built by build_engine


KINDS: dict[str, Kind] = {
    kind.name: kind
    for kind in (
        Kind(
            "scheduler",
            SchedulingPolicy,
            "servelab_register_schedulers",
            # the engine's SchedulerCore is built around the policy (engine.build)
            frozenset(),
            "continuous",
        ),
        # capacities in tokens, not blocks: the engine sizes every allocator from one
        # memory budget before knowing its block size
        Kind(
            "allocator",
            KVAllocator,
            "servelab_register_allocators",
            frozenset({"token_capacity", "host_token_capacity", "max_model_len"}),
            "paged",
        ),
        Kind(
            "preemption",
            PreemptionPolicy,
            "servelab_register_preemption_policies",
            frozenset(),
            "recompute",
        ),
        Kind(
            "attention",
            AttentionBackend,
            "servelab_register_attention_backends",
            frozenset({"num_heads", "num_kv_heads", "head_dim", "scale"}),
            "per_request",
        ),
        # built first: the model's shape and the KV budget come from it
        Kind(
            "executor",
            Executor,
            "servelab_register_executors",
            frozenset({"model", "hardware", "engine_options"}),
            "model",
        ),
        # speculative decoding's drafts; `none` proposes nothing (servelab.contracts.proposer)
        Kind(
            "proposer",
            Proposer,
            "servelab_register_proposers",
            frozenset({"vocab_size", "engine_options"}),
            "none",
        ),
        # below the device cache: where evicted prefix blocks go; `none` keeps none
        # (servelab.contracts.kv_tier). Built after the allocator, whose block size it keeps
        Kind(
            "kv_tier",
            KVTier,
            "servelab_register_kv_tiers",
            frozenset({"block_bytes", "kv_identity", "payloads"}),
            "none",
        ),
        # above the engine: a cluster builds one router for its replicas (servelab.cluster)
        Kind(
            "router",
            Router,
            "servelab_register_routers",
            frozenset({"num_replicas"}),
            "round_robin",
            in_engine=False,
        ),
    )
}


ENGINE_KINDS: tuple[str, ...] = tuple(name for name, k in KINDS.items() if k.in_engine)


def kind(name: str) -> Kind:
    """The kind called `name`; a `ConfigError` listing the kinds otherwise."""
    if name not in KINDS:
        raise ConfigError(f"unknown kind {name!r}; kinds: {', '.join(KINDS)}")
    return KINDS[name]
