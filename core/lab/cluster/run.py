"""One cluster run from a composed config (`servelab cluster=colocated cluster.replicas=8
router=least_load executor=simulated hardware=h100-sxm ...`): build the replicas and the
router, serve the workload on one virtual clock, summarize.

The summary is the single-engine summary over every replica's requests and steps (TTFT,
ITL, throughput...) plus what only a cluster has: the router, the replica count, the
requests routed to each replica, the load imbalance (most routed requests on one replica
over the mean), the requests sent to a busy replica while another was idle;
`prefix_hit_rate` is then
the cluster's (prefix-cached prompt tokens over those looked up, every replica together).

`ClusterResult`, `engine_config` and the other pieces both kinds of run share live in
lab/cluster/replica_set.py (re-exported here).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from servelab.cluster.dispatch import Dispatcher, StateFeed
from servelab.cluster.options import cluster_options, is_disaggregated
from servelab.contracts.kinds import KINDS
from servelab.engine.summary import summarize
from servelab.errors import ConfigError
from servelab.lab.cluster.replica_set import (
    ClusterResult,
    build_replicas,
    engine_config,
    executor_provenance,
    load_imbalance,
    per_replica,
    workload_node,
)
from servelab.lab.cluster.simulated import SimulatedCluster
from servelab.lab.gc_passes import fewer_gc_passes
from servelab.lab.runner import output_digest
from servelab.lab.workload import make_workload
from servelab.registry.construct import construct


def run_cluster(config: Mapping, feed: StateFeed | None = None) -> ClusterResult:
    """Builds and serves the cluster `config` describes (colocated, or prefill/decode:
    servelab.lab.cluster.run_disaggregated)."""
    options = cluster_options(config.get("cluster"))
    if options["backend"] == "ray":
        raise ConfigError(
            "cluster.backend=ray runs a real prefill/decode pair (cluster.prefill=1 "
            "cluster.decode=1, a real executor); replicas on Ray are served by "
            "`servelab route --ray N`, and a simulated cluster runs on one virtual clock"
        )
    with fewer_gc_passes():  # every replica runs on a virtual clock (SimulatedCluster checks)
        if is_disaggregated(options):
            from servelab.lab.cluster.run_disaggregated import run_disaggregated

            return run_disaggregated(config, options, feed)
        return _run_colocated(config, options, feed)


def _run_colocated(config: Mapping, options: Mapping, feed: StateFeed | None) -> ClusterResult:
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
    summary = summarize(records, steps, [(e.metrics.requests, e.metrics.steps) for e in engines])
    summary["output_digest"] = output_digest(cluster.tokens)  # equal digests: equal outputs
    summary.update(cluster_figures(engines, cluster.dispatcher))
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


def cluster_figures(engines: list, dispatcher: Dispatcher) -> dict[str, float | str]:
    """Replica count, the requests routed to each replica, the load imbalance (most requests
    routed to one replica over the mean) and the requests sent to a busy replica while
    another was idle; the prefix hit rate over every replica's steps is the summary's
    `prefix_hit_rate`."""
    routed = dispatcher.ledger.routed_count
    return {
        "replicas": len(engines),
        "load_imbalance": load_imbalance(routed),
        "requests_per_replica": per_replica(routed),
        "sent_to_busy_while_idle": dispatcher.sent_to_busy_while_idle,
    }



__all__ = [
    "ClusterResult",
    "engine_config",
    "run_cluster",
    "collect",
    "cluster_figures",
]
