"""One cluster run from a composed config (`servelab cluster=colocated cluster.replicas=8
router=least_load executor=simulated hardware=h100-sxm ...`): build the replicas and the
router, serve the workload on one virtual clock, summarize.

The summary is the single-engine summary over every replica's requests and steps (TTFT,
ITL, throughput...) plus what only a cluster has: the router, the replica count, the load
imbalance (most routed requests on one replica over the mean); `prefix_hit_rate` is then
the cluster's (prefix-cached prompt tokens over those looked up, every replica together).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from servelab.cluster.dispatch import Dispatcher, StateFeed
from servelab.cluster.options import cluster_options, is_disaggregated
from servelab.cluster.simulated import SimulatedCluster
from servelab.contracts.kinds import KINDS
from servelab.engine.build import build_engine
from servelab.engine.metrics import RequestRecord, StepRecord, summarize
from servelab.errors import ConfigError
from servelab.lab.runner import RUNNER_NODES, output_digest
from servelab.lab.workload import make_workload
from servelab.registry.construct import construct


@dataclass
class ClusterResult:
    summary: dict[str, float]
    requests: list[RequestRecord]
    steps: list[StepRecord]
    placement: dict[str, int]  # request id -> replica
    decisions: list[tuple[str, int]]  # the router's decisions, in arrival order
    tokens: dict[str, list[list[int]]] = field(default_factory=dict)
    # request id -> its requests.csv columns beyond the record's (default: its `replica`)
    columns: dict[str, dict] = field(default_factory=dict)
    # what timed the run, as a single engine's provenance records it (the report reads
    # `virtual_clock`: exact figures, no repeats needed)
    executor: dict = field(default_factory=dict)


def engine_config(config: Mapping) -> dict:
    """The config one replica is built from (the cluster's and the runner's nodes removed)."""
    return {k: v for k, v in config.items() if k not in (*RUNNER_NODES, "router")}


def workload_node(config: Mapping) -> Mapping:
    workload = config.get("workload")
    if workload is None:
        raise ConfigError("the config has no workload node; pick one with workload=NAME")
    return workload


def build_replicas(config: Mapping, count: int) -> list:
    return [build_engine(engine_config(config)) for _ in range(count)]


def run_cluster(config: Mapping, feed: StateFeed | None = None) -> ClusterResult:
    """Builds and serves the cluster `config` describes (colocated, or prefill/decode:
    servelab.cluster.run_disaggregated)."""
    options = cluster_options(config.get("cluster"))
    if is_disaggregated(options):
        from servelab.cluster.run_disaggregated import run_disaggregated

        return run_disaggregated(config, options, feed)
    workload = workload_node(config)
    engines = build_replicas(config, options["replicas"])
    router = construct(
        "router", config.get("router") or KINDS["router"].default, num_replicas=len(engines)
    )
    dispatcher = Dispatcher(router, len(engines), feed)
    cluster = SimulatedCluster(engines, dispatcher)
    first = engines[0]
    requests = make_workload(workload, first.model_config.vocab_size, first.max_model_len)
    cluster.run(requests)
    return collect(engines, cluster, router, options["record_steps"])


def collect(
    engines: list, cluster: SimulatedCluster, router: Any, keep_steps: bool
) -> ClusterResult:
    records = [r for e in engines for r in e.metrics.requests]
    steps = sorted((s for e in engines for s in e.metrics.steps), key=lambda s: s.start_time)
    summary = summarize(records, steps)
    summary["output_digest"] = output_digest(cluster.tokens)  # equal digests: equal outputs
    summary.update(cluster_figures(engines, cluster.dispatcher.ledger.routed_count))
    summary["router"] = getattr(router, "name", type(router).__name__)
    return ClusterResult(
        summary,
        records,
        steps if keep_steps else [],
        dict(cluster.placement),
        list(cluster.dispatcher.decisions),
        dict(cluster.tokens),
        executor=executor_provenance(engines[0]),
    )


def executor_provenance(engine) -> dict:
    return {"virtual_clock": bool(engine.executor.virtual_clock), **engine.executor.describe()}


def cluster_figures(engines: list, routed: list[int]) -> dict[str, float]:
    """Replica count and load imbalance (most requests routed to one replica over the mean);
    the prefix hit rate over every replica's steps is the summary's `prefix_hit_rate`."""
    mean = sum(routed) / len(routed) if routed else 0.0
    return {"replicas": len(engines), "load_imbalance": max(routed) / mean if mean else 1.0}
