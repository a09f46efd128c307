"""The throughput benchmark's rows and reports, and the device check's merged report.

`gpu_throughput.py` writes `gpu_throughput.{md,json}` into `--out` (`--merge`
joins several) and, with `--records FILE`, appends every run's row to FILE as
the run goes. `gpu_check.sh` appends each phase's record (planned, started,
done: name, exit status, seconds, time limit, log) to the same file,
`records.jsonl`; `python benchmarks/gpu_report.py --check FOLDER` turns it
into `gpu_check.json` and `gpu_check.md`: every planned phase listed (one that
never ran says so), a row still "running" in a phase that timed out says which
stage it stopped in, and only rows that finished show figures.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import asdict, dataclass, field

RECORDS = "records.jsonl"


@dataclass
class RunResult:
    backend: str
    graphs: str
    status: str = "ok"
    requests: int = 0  # the requests this run was given
    requests_done: int = 0
    output_tokens: int = 0
    wall_s: float = 0.0
    output_tok_s: float = 0.0
    decode_steps: int = 0
    decode_tok_s: float = 0.0
    roofline_fraction: float = float("nan")
    bandwidth: float = 0.0  # this process's measured copy bandwidth, bytes/s
    kv_cache_bytes: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def has_figures(self) -> bool:
        """Only a run that finished its timed loop without an error has figures."""
        return self.status.startswith(("ok", "partial")) and self.wall_s > 0


def table(results: list[RunResult]) -> str:
    lines = [
        "| backend | graphs | output tok/s | decode tok/s | decode roofline | done | wall s "
        "| copy GB/s | status |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        status = "; ".join([r.status, *r.notes])
        copy = f"{r.bandwidth / 1e9:,.0f}" if r.bandwidth else "-"
        if not r.has_figures:  # skipped, failed or stopped: no figures
            lines.append(f"| {r.backend} | {r.graphs} | - | - | - | - | - | {copy} | {status} |")
            continue
        roof = "-" if math.isnan(r.roofline_fraction) else f"{100 * r.roofline_fraction:.1f}%"
        lines.append(
            f"| {r.backend} | {r.graphs} | {r.output_tok_s:,.0f} | {r.decode_tok_s:,.0f} | "
            f"{roof} | {r.requests_done}/{r.requests} | {r.wall_s:.1f} | {copy} | {status} |"
        )
    return "\n".join(lines)


def write_report(args, header: str, results: list[RunResult]) -> str:
    report = header + "\n\n" + table(results) + "\n"
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "gpu_throughput.md"), "w") as f:
            f.write(report)
        runs = [asdict(r) for r in results]
        with open(os.path.join(args.out, "gpu_throughput.json"), "w") as f:
            json.dump({"header": header, "runs": runs}, f, indent=1)
    return report


def merge(folders: list[str], out: str | None) -> str:
    """One report from the gpu_throughput.json of several runs (one per folder)."""
    parts = [
        json.loads(open(os.path.join(f, "gpu_throughput.json")).read())
        for f in folders
        if os.path.isfile(os.path.join(f, "gpu_throughput.json"))
    ]
    if not parts:
        return "no results"
    results = [RunResult(**run) for part in parts for run in part["runs"]]
    return write_report(argparse.Namespace(out=out), parts[0]["header"], results)


def read_records(path: str) -> tuple[dict[str, dict], list[RunResult], str | None]:
    """(phases by name, last record of each; each run's last row; the header)."""
    phases: dict[str, dict] = {}
    runs: dict[tuple[str, str], dict] = {}
    header = None
    with open(path) as f:
        for line in f:
            record = json.loads(line)
            kind = record.pop("kind")
            if kind == "phase":
                phases[record["name"]] = {**phases.get(record["name"], {}), **record}
            elif kind == "run":
                runs[record["backend"], record["graphs"]] = record
            elif kind == "header":
                header = record["text"]
    return phases, [RunResult(**r) for r in runs.values()], header


def phase_status(rc: str) -> str:
    return {"planned": "not run", "started": "cut off", "0": "ok", "124": "timed out"}.get(
        rc, "killed at its limit" if rc == "137" else f"exit {rc}"
    )


def check_report(folder: str) -> str:
    """`gpu_check.{json,md}` in `folder` from its `records.jsonl`."""
    phases, runs, header = read_records(os.path.join(folder, RECORDS))
    for p in phases.values():
        p["status"] = phase_status(str(p["rc"]))
    for run in runs:  # its process died before it could say: the phase's record says why
        if run.status.startswith(("running", "not started")):
            run.status = f"stopped ({run.status}): no figures"
    with open(os.path.join(folder, "gpu_check.json"), "w") as f:
        json.dump(
            {"phases": list(phases.values()), "header": header, "runs": [asdict(r) for r in runs]},
            f,
            indent=1,
        )
    lines = ["| phase | status | seconds | limit s | log |", "|---|---|---:|---:|---|"]
    lines += [
        f"| {p['name']} | {p['status']} | {p['seconds']} | {p['limit_s']} | {p['log']} |"
        for p in phases.values()
    ]
    lines.append(f"\nplanned limits: {sum(int(p['limit_s']) for p in phases.values())} s")
    report = "\n".join(lines) + "\n"
    if runs:
        report += "\n" + (header or "") + "\n\n" + table(runs) + "\n"
    with open(os.path.join(folder, "gpu_check.md"), "w") as f:
        f.write(report)
    return report


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "--check":
        raise SystemExit("usage: python benchmarks/gpu_report.py --check FOLDER")
    print(check_report(sys.argv[2]))
