"""Runs one configured engine over a workload, against the engine's clock, and
writes what it measured.

A request enters the engine when its arrival time has come (seconds after the
run starts); meanwhile the engine steps, and when it has nothing to do (an
empty queue, or a batcher waiting for its batch) the runner sleeps briefly.
The arrival time a request carries is the scheduled one, so a late admission
counts as queueing. A follow-up request (`after`) enters once the request it
follows has finished (servelab.lab.arrivals). The clock is the executor's: the
wall clock for the real model; a virtual one for `executor=simulated`, where
waiting for the next arrival jumps to it instead of sleeping.
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import json
import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
from rich.progress import Progress as Progress_
from rich.table import Table

from servelab.contracts.kv_tier import DEFAULT_FOLDER
from servelab.engine.build import build_engine
from servelab.engine.engine import Engine
from servelab.engine.metrics import RequestRecord, StepRecord
from servelab.engine.summary import summarize
from servelab.errors import ConfigError
from servelab.lab.arrivals import ArrivalQueue
from servelab.lab.fairness import fairness_figures
from servelab.lab.gc_passes import fewer_gc_passes
from servelab.lab.progress import Progress, is_terminal
from servelab.lab.provenance import cpu_snapshot, machine_load, provenance
from servelab.lab.report import report_options
from servelab.lab.simulated_label import label, simulation
from servelab.lab.workload import WorkloadRequest, make_workload, trace_source
from servelab.registry.typed import check_value
from servelab.step.sequence import SamplingParams

RUN_DEFAULTS: dict[str, Any] = {
    "progress": True,  # progress: a live bar on a terminal, plain lines otherwise
    "warmup": True,  # one short request before the clock starts: first-call costs stay out
    "idle_sleep": 0.0005,  # seconds the runner sleeps when the engine has nothing to run
    "repeats": 1,  # how many times each configuration runs, each with a fresh engine
    "repeat": 0,  # which of those runs this is (a sweep sets it: see conf/config.yaml)
    # the folder a disk KV tier keeps its blocks in (conf/kv_tier/disk.yaml reads it): a
    # preset whose runs must each start cold gives each run its own
    "kv_tier_folder": DEFAULT_FOLDER,
}
RUN_TYPES: dict[str, Any] = {
    "progress": bool,
    "warmup": bool,
    "idle_sleep": float,
    "repeats": int,
    "repeat": int,
    "kv_tier_folder": str,
}
# top-level config nodes the runner consumes; the rest goes to build_engine
RUNNER_NODES = (
    "workload",
    "run",
    "report",
    "serve",
    "cluster",  # a cluster of engines: servelab.lab.cluster
)  # not engine nodes: build_engine never sees them


@dataclass
class RunResult:
    engine: Engine
    summary: dict[str, float]
    requests: list[RequestRecord]
    steps: list[StepRecord]
    provenance: dict[str, Any] = field(default_factory=dict)


def run_options(node: Mapping | None) -> dict[str, Any]:
    options = dict(RUN_DEFAULTS)
    for key, value in (node or {}).items():
        if key not in RUN_DEFAULTS:
            raise ConfigError(
                f"unknown run option {key!r}; accepted: {', '.join(sorted(RUN_DEFAULTS))}"
            )
        options[key] = value
    for key, annotation in RUN_TYPES.items():
        check_value(f"run option {key}", options[key], annotation)
    if options["repeats"] < 1 or options["repeat"] < 0:
        raise ConfigError(
            f"run option repeats must be >= 1 and repeat >= 0, got repeats={options['repeats']!r}"
            f" repeat={options['repeat']!r}"
        )
    if options["idle_sleep"] < 0:
        raise ConfigError(
            f"run option idle_sleep must be >= 0 seconds, got {options['idle_sleep']!r}"
        )
    return options


def warm_up(engine: Engine) -> None:
    """Serves one tiny request, then forgets its records. Its prompt is shorter
    than any KV block, so it leaves nothing in a prefix cache."""
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    engine.add_request([2, 3, 4], params, request_id="__warmup__")
    while engine.has_unfinished():
        steps_before = len(engine.metrics.steps)
        engine.step()
        if len(engine.metrics.steps) == steps_before:  # a batcher waiting for its timeout
            engine.sleep(RUN_DEFAULTS["idle_sleep"])
    engine.metrics.start_run()


def serve(
    engine: Engine,
    requests: list[WorkloadRequest],
    progress: bool = False,
    idle_sleep: float = RUN_DEFAULTS["idle_sleep"],
) -> dict[str, float]:
    """Feeds `requests` to `engine` as their arrival times come (a follow-up once
    the request it follows has finished: servelab.lab.arrivals), steps until
    every request has finished, and returns the run summary."""
    arrivals = ArrivalQueue(requests)
    bar = ProgressBar(arrivals.total, enabled=progress)
    start = engine.now()
    virtual = engine.executor.virtual_clock
    tokens: dict[str, list[list[int]]] = {}
    with bar, fewer_gc_passes() if virtual else contextlib.nullcontext():
        while arrivals or engine.has_unfinished():
            now = engine.now() - start
            for req in arrivals.pop_due(now):
                engine.add_request(
                    req.prompt_token_ids,
                    req.params,
                    request_id=req.request_id,
                    arrival_time=start + req.arrival_time,
                    priority=req.priority,
                    client=req.client,
                )
                arrivals.sent(req)
            if engine.has_unfinished():
                steps_before = len(engine.metrics.steps)
                for output in engine.step():
                    tokens[output.request_id] = [o.token_ids for o in output.outputs]
                    arrivals.finished(output.request_id, output.token_ids, engine.now() - start)
                if len(engine.metrics.steps) == steps_before:  # nothing ran: a batcher waits
                    engine.sleep(idle_sleep)
                bar.update(engine, now)
            elif arrivals.next_time() is not None:
                gap = max(0.0, arrivals.next_time() - now)
                # a real clock wakes up often (arrivals are checked against it); a virtual one jumps
                engine.sleep(gap if virtual else min(gap, 0.01))
            elif arrivals:  # cannot happen: every followed request reaches the engine
                raise RuntimeError("follow-up requests wait for requests that never ran")
    summary = summarize(engine.metrics.requests, engine.metrics.steps)
    summary["output_digest"] = output_digest(tokens)
    summary.update(client_figures(engine))
    engine.events.notify("servelab_run_end", engine=engine, summary=summary)
    return summary


def output_digest(tokens: dict[str, list[list[int]]]) -> str:
    """A short hash of every request's output tokens: equal digests, equal outputs."""
    text = json.dumps(sorted(tokens.items()), separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


class ProgressBar:
    """Finished requests and output tok/s: a live rich bar on a terminal, plain
    lines on stderr otherwise (a log, nohup, CI: lab/progress.py); a no-op
    when disabled."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.enabled = enabled
        self.terminal = enabled and is_terminal(sys.stdout)  # where rich draws
        self.plain = Progress("serving", total, enabled=enabled and not self.terminal)
        self.progress = Progress_(
            TextColumn("[bold]serving"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("requests"),
            TextColumn("{task.fields[tok_s]:>8.1f} tok/s"),
            TimeElapsedColumn(),
            transient=True,
            disable=not self.terminal,
        )
        self.task = self.progress.add_task("serve", total=total, tok_s=0.0)
        self.tokens = 0
        self.seen_steps = 0

    def __enter__(self) -> ProgressBar:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.__exit__(*exc)

    def update(self, engine: Engine, elapsed: float) -> None:
        if not self.enabled:
            return
        steps = engine.metrics.steps
        self.tokens += sum(s.sampled_tokens for s in steps[self.seen_steps :])
        self.seen_steps = len(steps)
        rate = self.tokens / elapsed if elapsed > 0 else 0.0
        done = len(engine.metrics.requests)
        if self.terminal:
            self.progress.update(self.task, completed=done, tok_s=rate)
        elif done > self.plain.done:
            self.plain.advance("requests", steps=done - self.plain.done, detail=f"{rate:.1f} tok/s")


def client_figures(engine) -> dict[str, float]:
    """Per-client service and TTFT (lab/fairness.py) when requests carry clients, weighted
    as the scheduler weighs them (VTC's w_prompt and w_output; else its defaults, 1 and 2)."""
    requests = engine.metrics.requests
    if not any(r.client is not None for r in requests):
        return {}
    rows = [{**r.row(), "token_steps": r.token_steps} for r in requests]
    steps = [s.row() for s in engine.metrics.steps]
    weights = (getattr(engine.scheduler, w, d) for w, d in (("w_prompt", 1.0), ("w_output", 2.0)))
    return fairness_figures(rows, steps, *weights)


def run_config(config: Mapping) -> RunResult:
    """Builds the engine of `config`, serves its workload, returns the records."""
    config = dict(config)
    workload = config.pop("workload", None)
    if workload is None:
        raise ConfigError("the config has no workload node; pick one with workload=NAME")
    options = run_options(config.pop("run", None))
    report_options(config.pop("report", None))  # checked now, used by servelab-report
    for node in RUNNER_NODES:  # `servelab serve`'s node, an empty cluster node
        config.pop(node, None)
    started = provenance({**config, "workload": workload, "run": options}, model_name(config))
    engine = build_engine(config)
    # what timed the run: a virtual clock makes every figure a deterministic function
    # of the config (the report then needs no repeats), and a hardware profile's values
    started["executor"] = {
        "virtual_clock": bool(engine.executor.virtual_clock),
        **engine.executor.describe(),
    }
    simulated = simulation(started, {"executor": part_name(config.get("executor"))})
    if simulated:  # what every table and plot of this run will say of it
        started["simulated"] = simulated
    requests = make_workload(workload, engine.model_config.vocab_size, engine.max_model_len)
    started.update(trace_source(requests))  # a public trace: its file, hash and what was capped
    if options["warmup"]:
        warm_up(engine)
    before = cpu_snapshot()
    summary = serve(engine, requests, bool(options["progress"]), float(options["idle_sleep"]))
    started["machine_load"] = machine_load(before, cpu_snapshot())
    records = list(engine.metrics.requests), list(engine.metrics.steps)
    return RunResult(engine, summary, *records, provenance=started)


def part_name(node: Any) -> str | None:
    """A part's name from its config node (`{name: simulated, ...}` or `simulated`)."""
    return node.get("name") if isinstance(node, Mapping) else (str(node) if node else None)


def model_name(config: Mapping) -> str:
    """The model as loaded: a checkpoint folder's name, else the named shape."""
    node = config.get("model") or {}
    if isinstance(node, str):
        return node
    path = node.get("path")
    return Path(str(path)).name if path else str(node.get("name", "?"))


# -- outputs


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN; a missing figure reads as null
    return value


def save_run(folder: str | Path, result: RunResult, config: Mapping, meta: Mapping) -> None:
    """Writes `results.json` (config, meta, summary), `requests.csv`, `steps.csv`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    results = {
        "config": config,
        **meta,
        "status": "ok",
        "provenance": result.provenance,
        "summary": {k: _jsonable(v) for k, v in result.summary.items()},
    }
    (folder / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    write_csv(folder / "requests.csv", [r.csv_row() for r in result.requests])
    write_csv(folder / "steps.csv", [s.row() for s in result.steps])


def save_failed_run(folder: str | Path, config: Mapping, meta: Mapping, error: str) -> None:
    """Writes `results.json` for a run that failed: its config, `status: error`
    and the message (no summary, no CSV files)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    results = {
        "config": config,
        **meta,
        "status": "error",
        "error": error,
        "provenance": provenance(config, model_name(config)),
        "summary": {},
    }
    (folder / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n")


def write_csv(path: Path, rows: list[dict]) -> None:
    columns: list[str] = []
    for row in rows:
        columns += [k for k in row if k not in columns]
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)


SUMMARY_SECTIONS = {
    "throughput": ("requests", "wall_time_s", "request_throughput", "output_tok_s", "total_tok_s"),
    "latency (ms)": (
        "ttft_p50_ms", "ttft_p99_ms", "tpot_mean_ms", "itl_p50_ms", "itl_p99_ms",
        "e2e_p50_ms", "longest_stall_ms",
    ),
    "memory": (
        "kv_util_pct", "reservation_waste_pct", "peak_seqs", "prefix_hit_rate",
        "preemptions", "recomputed_tokens", "swapped_out_bytes",
    ),
    "batching": ("steps", "step_ms_mean", "padding_waste_pct", "idle_slot_pct", "prefill_tokens"),
}  # fmt: skip
# a cluster run's own figures (lab/cluster/run.py): how the router spread the requests
CLUSTER_SECTION = ("replicas", "router", "requests_per_replica", "load_imbalance",
                   "sent_to_busy_while_idle")  # fmt: skip
# a run with a proposer's own figures (docs/speculative.md)
SPECULATION_SECTION = ("spec_draft_tokens", "spec_acceptance_pct", "spec_mean_accepted_length",
                       "spec_proposer_errors", "spec_paused_steps")  # fmt: skip
# a run with a KV tier's own figures (docs/kv_tiers.md)
TIER_SECTION = ("tier_hit_rate", "tier_hit_tokens", "tier_bytes_loaded", "tier_bytes_stored",
                "tier_load_ms", "tier_store_ms", "tier_load_failures")  # fmt: skip


def print_summary(
    summary: dict,
    title: str = "servelab run",
    console: Console | None = None,
    simulated: Mapping | None = None,
) -> None:
    """The run's figures as a table; a simulated run's (`simulated`: its record,
    lab/simulated_label.py) titled with its label, its run time as virtual."""
    table = Table(title=title)
    table.add_column("figure")
    table.add_column("value", justify="right")
    sections = dict(SUMMARY_SECTIONS)
    if "replicas" in summary:
        sections["cluster"] = tuple(k for k in CLUSTER_SECTION if k in summary)
    if "spec_draft_tokens" in summary:
        sections["speculative decoding"] = SPECULATION_SECTION
    if "tier_hits" in summary:
        sections["kv tier"] = TIER_SECTION
    for section, keys in sections.items():
        table.add_section()
        table.add_row(f"[bold]{section}", "")
        for key in keys:
            value = summary.get(key)
            shown = "virtual_time_s" if simulated and key == "wall_time_s" else key
            table.add_row(shown, f"{value:.4g}" if isinstance(value, float) else str(value))
    console = console or Console()
    console.print(table)
    if simulated:  # under the table, unwrapped: the line a reader copies with the figures
        console.print(label(simulated), style="bold magenta", highlight=False, soft_wrap=True)
