"""`servelab cluster=colocated ...`: a cluster run from the command line. The Hydra app
(servelab.cli) hands any config with a `cluster:` node here; results.json, requests.csv
(with each request's replica) and steps.csv go to the run's folder as for one engine, so
`servelab-report` compares cluster runs (e.g. `-m router=round_robin,prefix_affinity`)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from servelab.lab.cluster.run import run_cluster
from servelab.lab.provenance import provenance
from servelab.lab.runner import RunResult, model_name, print_summary, save_run
from servelab.lab.simulated_label import simulation
from servelab.lab.sweep import job_line


def run_cluster_job(config: dict, meta: dict, folder: Path, in_sweep: bool = False) -> dict:
    # the cluster steps its replicas itself (no warm-up, no progress bar); the saved config
    # is the whole one, as for one engine: servelab-report reads its `report:` node
    served = {k: v for k, v in config.items() if k not in ("run", "report")}
    started = provenance(served, model_name(served))
    result = run_cluster(served)
    started["executor"] = result.executor
    simulated = simulation(started, meta.get("choices"))
    if simulated:  # what every table and plot of this run will say of it
        started["simulated"] = simulated
    records = [_Row(r, _columns(r.request_id, result)) for r in result.requests]
    save_run(folder, RunResult(None, result.summary, records, result.steps, started), config, meta)
    if in_sweep:  # a sweep's one line per job (servelab.lab.sweep)
        num = (meta.get("job") or {}).get("num")
        line = job_line(num, meta["overrides"], folder, result.summary, simulated=simulated)
        print(line, flush=True)
        return result.summary
    title = ", ".join(f"{k}={_name(config.get(k))}" for k in ("cluster", "router", "scheduler"))
    print_summary(result.summary, title=f"{title}\n{folder}", simulated=simulated)
    return result.summary


class _Row:
    """A request record whose CSV row also names where it ran (its replica; prefill and
    decode instances and the KV transfer in a disaggregated cluster)."""

    def __init__(self, record, columns: Mapping) -> None:
        self.record, self.columns = record, columns

    def csv_row(self) -> dict:
        return {**self.record.csv_row(), **self.columns}


def _columns(request_id: str, result) -> Mapping:
    if result.columns:
        return result.columns.get(request_id, {})
    return {"replica": result.placement.get(request_id)}


def _name(node) -> str:
    if isinstance(node, Mapping):
        return str(node.get("name", {k: v for k, v in node.items() if v}))
    return str(node)
