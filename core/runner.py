"""Runs one configured engine over a workload and prints the summary."""

from __future__ import annotations

from collections.abc import Mapping

from rich.console import Console
from rich.table import Table

from servelab.build import build_engine
from servelab.engine import Engine
from servelab.workload import WorkloadRequest, make_workload


def run_workload(engine: Engine, requests: list[WorkloadRequest]) -> dict:
    for i, req in enumerate(requests):
        engine.add_request(
            req.prompt_token_ids,
            req.params,
            request_id=req.request_id or f"req-{i}",
            priority=req.priority,
        )
    while engine.has_unfinished():
        engine.step()
    summary = engine.metrics.summary()
    engine.notify("servelab_run_end", engine=engine, summary=summary)
    return summary


def run_config(config: Mapping) -> dict:
    config = dict(config)
    workload = config.pop("workload")
    engine = build_engine(config)
    requests = make_workload(workload, engine.model_config.vocab_size)
    return run_workload(engine, requests)


def print_summary(summary: dict, title: str = "servelab run") -> None:
    table = Table(title=title)
    table.add_column("figure")
    table.add_column("value", justify="right")
    for key, value in summary.items():
        table.add_row(key, f"{value:.4g}" if isinstance(value, float) else str(value))
    Console().print(table)
