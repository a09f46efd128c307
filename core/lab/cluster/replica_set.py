"""What a cluster run is made of, shared by the colocated run (lab/cluster/run.py) and the
prefill/decode one (lab/cluster/run_disaggregated.py): the result, one replica's config
and engines, the workload node, the executor's provenance, the routed-requests figures. Kept apart from both so
neither imports the other (run.py picks one of them per config).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from servelab.engine.build import build_engine
from servelab.engine.metrics import RequestRecord, StepRecord
from servelab.errors import ConfigError
from servelab.lab.runner import RUNNER_NODES


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


def executor_provenance(engine) -> dict:
    return {"virtual_clock": bool(engine.executor.virtual_clock), **engine.executor.describe()}


def load_imbalance(routed: list[int]) -> float:
    """Most requests routed to one replica over the mean (1.0: even)."""
    mean = sum(routed) / len(routed) if routed else 0.0
    return max(routed) / mean if mean else 1.0


def per_replica(routed: list[int]) -> str:
    """The requests routed to each replica, in replica order: `13 8 4 7`."""
    return " ".join(str(n) for n in routed)
