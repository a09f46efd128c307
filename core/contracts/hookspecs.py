"""Every pluggy hook of servelab, prefixed `servelab_`.

A plugin is any module or object whose functions carry `@hookimpl` and are named after one
of these specifications; an implementation may accept fewer arguments than its spec lists.
- registration hooks collect parts from every plugin (none is `firstresult`): each returns
  `{name: class}`; the plugin manager checks the classes against the contracts in
  `servelab.contracts` and rejects duplicate names;
- event hooks observe the engine; each implementation is called in isolation, so an
  observer that raises is reported and never stops the engine. Their `engine` argument is
  the `servelab.engine.engine.Engine` that fires them, typed `Any`: the contracts sit below the
  engine and import nothing of it, not even for type checking.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from hydra.core.config_store import ConfigStore

PROJECT = "servelab"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


# -- registration


@hookspec
def servelab_register_schedulers() -> dict[str, type]:
    """Scheduling policies this plugin provides: `{name: subclass of
    servelab.contracts.scheduler.SchedulingPolicy}` (the engine runs each in a `SchedulerCore`)."""


@hookspec
def servelab_register_allocators() -> dict[str, type]:
    """KV allocators this plugin provides: `{name: subclass of servelab.contracts.allocator.KVAllocator}`."""


@hookspec
def servelab_register_preemption_policies() -> dict[str, type]:
    """Preemption policies this plugin provides: `{name: subclass of servelab.contracts.preemption.PreemptionPolicy}`."""


@hookspec
def servelab_register_attention_backends() -> dict[str, type]:
    """Attention backends this plugin provides: `{name: subclass of servelab.contracts.attention.AttentionBackend}`."""


@hookspec
def servelab_register_executors() -> dict[str, type]:
    """Executors this plugin provides: `{name: subclass of servelab.contracts.executor.Executor}`."""


@hookspec
def servelab_register_proposers() -> dict[str, type]:
    """Speculative-decoding proposers this plugin provides: `{name: subclass of servelab.contracts.proposer.Proposer}`."""


@hookspec
def servelab_register_kv_tiers() -> dict[str, type]:
    """KV tiers this plugin provides: `{name: subclass of servelab.contracts.kv_tier.KVTier}`."""


@hookspec
def servelab_register_routers() -> dict[str, type]:
    """Cluster routers this plugin provides: `{name: subclass of servelab.contracts.router.Router}`."""


@hookspec
def servelab_register_configs(store: ConfigStore) -> None:
    """Adds Hydra config-group options to `store`, e.g.
    `store.store(group="scheduler", name="sjf", node={"name": "sjf", ...})`
    so `scheduler=sjf` works on the command line."""


# -- events (observers: return values are ignored)


@hookspec
def servelab_engine_ready(engine: Any) -> None:
    """The engine is built (model loaded, KV cache allocated) and about to serve."""


@hookspec
def servelab_step_end(engine: Any, step: dict[str, Any]) -> None:
    """One engine step finished; `step` is that step's metrics record."""


@hookspec
def servelab_request_end(engine: Any, request: dict[str, Any]) -> None:
    """One request finished (stopped, length, aborted or rejected); `request` is its metrics record."""


@hookspec
def servelab_run_end(engine: Any, summary: dict[str, Any]) -> None:
    """A run (`generate` call or CLI workload) finished; `summary` holds its aggregate metrics."""
