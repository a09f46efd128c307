"""One prefill/decode cluster run from a composed config (`servelab cluster=disaggregated
cluster.prefill=2 cluster.decode=2 cluster.link=nvlink executor=simulated ...`).

The summary is the single-engine summary over each request's joined record (servelab.
cluster.handoff: TTFT at the prefill instance's first token, later tokens at the decode
instance) and every instance's steps, plus what disaggregation adds: the instance counts,
the KV transfers' times and bytes, how long transferred requests waited to be admitted.
`replicas` is the GPU count, prefill and decode instances together.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from servelab.cluster.dispatch import Dispatcher, StateFeed
from servelab.cluster.links import link
from servelab.contracts.kinds import KINDS
from servelab.engine.summary import percentiles, summarize
from servelab.lab.cluster.disaggregated import DisaggregatedCluster
from servelab.lab.cluster.handoff import joined_record
from servelab.lab.cluster.replica_set import (
    ClusterResult,
    build_replicas,
    executor_provenance,
    load_imbalance,
    per_replica,
    workload_node,
)
from servelab.lab.runner import output_digest
from servelab.lab.workload import make_workload
from servelab.registry.construct import construct


def run_disaggregated(
    config: Mapping, options: Mapping[str, Any], feed: StateFeed | None = None
) -> ClusterResult:
    """`feed` (a test's scripted replica states) goes to the prefill router."""
    wire = link(options["link"])  # a misspelt link is reported before anything is built
    workload = workload_node(config)
    prefill = build_replicas(config, options["prefill"])
    decode = build_replicas(config, options["decode"])
    router = construct(
        "router", config.get("router") or KINDS["router"].default, num_replicas=len(prefill)
    )
    decode_router = construct("router", options["decode_router"], num_replicas=len(decode))
    cluster = DisaggregatedCluster(
        prefill,
        decode,
        Dispatcher(router, len(prefill), feed),
        Dispatcher(decode_router, len(decode)),
        wire,
        transfer=options["transfer"],
    )
    first = prefill[0]
    cluster.run(make_workload(workload, first.model_config.vocab_size, first.max_model_len))
    return collect(cluster, router, options["record_steps"])


def collect(cluster: DisaggregatedCluster, router: Any, keep_steps: bool) -> ClusterResult:
    engines = cluster.engines
    halves = [{r.request_id: r for r in e.metrics.requests} for e in engines]
    prefill_records = {k: v for h in halves[: cluster.num_prefill] for k, v in h.items()}
    decode_records = {k: v for h in halves[cluster.num_prefill :] for k, v in h.items()}
    records, columns = [], {}
    for request_id, prefill in prefill_records.items():
        handoff = cluster.handoffs[request_id]
        record, columns[request_id] = joined_record(
            prefill, decode_records.get(request_id), handoff
        )
        records.append(record)
    steps = sorted((s for e in engines for s in e.metrics.steps), key=lambda s: s.start_time)
    # each engine's own requests and steps too (the joined records mix two engines' steps)
    summary = summarize(records, steps, [(e.metrics.requests, e.metrics.steps) for e in engines])
    summary["output_digest"] = output_digest(cluster.tokens)
    summary.update(transfer_figures(columns.values()))
    summary.update(instance_figures(cluster))
    summary["router"] = getattr(router, "name", type(router).__name__)
    return ClusterResult(
        summary,
        records,
        steps if keep_steps else [],
        cluster.placement,
        list(cluster.prefill_dispatcher.decisions),
        dict(cluster.tokens),
        columns,
        executor_provenance(engines[0]),
    )


def transfer_figures(columns) -> dict[str, float]:
    """The KV transfers' seconds (as the link prices them) and their wait for admission."""
    moved = [c for c in columns if c["transfer_s"] is not None]
    waits = [c["transfer_wait_s"] for c in moved if c["transfer_wait_s"] is not None]
    transfer = percentiles(1000.0 * c["transfer_s"] for c in moved)
    wait = percentiles(1000.0 * w for w in waits)
    return {
        "kv_transfers": len(moved),
        "kv_transfer_gb": sum(c["kv_transfer_bytes"] for c in moved) / 1e9,
        **{f"transfer_ms_{k}": v for k, v in transfer.items()},
        **{f"transfer_wait_ms_{k}": v for k, v in wait.items()},
    }


def instance_figures(cluster: DisaggregatedCluster) -> dict[str, float]:
    prefill = cluster.prefill_dispatcher.ledger.routed_count
    decode = cluster.decode_dispatcher.ledger.routed_count
    decoders = cluster.engines[cluster.num_prefill :]
    return {
        # transfers that found their decode instance full and ran their prompt again there
        "transfers_recomputed": sum(
            e.scheduler.stats().get("prefilled_recomputed", 0) for e in decoders
        ),
        "decode_prefill_tokens": sum(s.prefill_tokens for e in decoders for s in e.metrics.steps),
        "replicas": len(cluster.engines),  # GPUs: prefill and decode instances together
        "prefill_replicas": len(prefill),
        "decode_replicas": len(decode),
        "load_imbalance": load_imbalance(prefill),
        "decode_load_imbalance": load_imbalance(decode),
        "requests_per_replica": per_replica(prefill),  # the prefill instances'
        "requests_per_decode_replica": per_replica(decode),
        "sent_to_busy_while_idle": cluster.prefill_dispatcher.sent_to_busy_while_idle,
    }
