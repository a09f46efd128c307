"""The throughput benchmark's rows and reports, and the device check's merged report.

`gpu_throughput.py` writes `gpu_throughput.{md,json}` per run folder (`--merge`
joins several); `gpu_check.sh` records each phase (name, exit status, seconds,
time limit, log) in `phases.tsv`, and `python benchmarks/gpu_report.py --check
FOLDER RUNS...` merges the runs and turns that into `gpu_check.json` and
`gpu_check.md`: every planned phase listed, one that never ran says so.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import asdict, dataclass, field


@dataclass
class RunResult:
    backend: str
    graphs: str
    status: str = "ok"
    requests_done: int = 0
    output_tokens: int = 0
    wall_s: float = 0.0
    output_tok_s: float = 0.0
    decode_steps: int = 0
    decode_tok_s: float = 0.0
    roofline_fraction: float = float("nan")
    kv_cache_bytes: int = 0
    notes: list[str] = field(default_factory=list)


def table(results: list[RunResult]) -> str:
    lines = [
        "| backend | graphs | output tok/s | decode tok/s | decode roofline | done | wall s | status |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        status = "; ".join([r.status, *r.notes])
        if not r.wall_s:  # skipped or refused: no figures
            lines.append(f"| {r.backend} | {r.graphs} | - | - | - | - | - | {status} |")
            continue
        roof = "-" if math.isnan(r.roofline_fraction) else f"{100 * r.roofline_fraction:.1f}%"
        lines.append(
            f"| {r.backend} | {r.graphs} | {r.output_tok_s:,.0f} | {r.decode_tok_s:,.0f} | "
            f"{roof} | {r.requests_done} | {r.wall_s:.1f} | {status} |"
        )
    return "\n".join(lines)


def write_report(args, header: str, bandwidth: float, results: list[RunResult]) -> str:
    report = header + "\n\n" + table(results) + "\n"
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "gpu_throughput.md"), "w") as f:
            f.write(report)
        runs = [asdict(r) for r in results]
        with open(os.path.join(args.out, "gpu_throughput.json"), "w") as f:
            json.dump(
                {"header": header, "bandwidth_bytes_per_s": bandwidth, "runs": runs}, f, indent=1
            )
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
    args = argparse.Namespace(out=out)
    return write_report(args, parts[0]["header"], parts[0]["bandwidth_bytes_per_s"], results)


def check_report(folder: str) -> str:
    """`gpu_check.{json,md}` in `folder` from its `phases.tsv` and `gpu_throughput.json`."""
    phases = []
    with open(os.path.join(folder, "phases.tsv")) as f:
        for line in f:
            name, rc, seconds, limit, log = line.rstrip("\n").split("\t")
            status = {"planned": "not run", "0": "ok", "124": "timed out"}.get(rc, f"exit {rc}")
            phases.append(
                dict(name=name, status=status, rc=rc, seconds=seconds, limit_s=limit, log=log)
            )
    # a phase appears once planned and again when done: the last record wins
    merged = {p["name"]: p for p in phases}
    throughput_path = os.path.join(folder, "gpu_throughput.json")
    throughput = json.load(open(throughput_path)) if os.path.isfile(throughput_path) else None
    with open(os.path.join(folder, "gpu_check.json"), "w") as f:
        json.dump({"phases": list(merged.values()), "throughput": throughput}, f, indent=1)
    lines = ["| phase | status | seconds | limit s | log |", "|---|---|---:|---:|---|"]
    lines += [
        f"| {p['name']} | {p['status']} | {p['seconds']} | {p['limit_s']} | {p['log']} |"
        for p in merged.values()
    ]
    report = "\n".join(lines) + "\n"
    if throughput is not None:
        runs = [RunResult(**run) for run in throughput["runs"]]
        report += "\n" + throughput["header"] + "\n\n" + table(runs) + "\n"
    with open(os.path.join(folder, "gpu_check.md"), "w") as f:
        f.write(report)
    return report


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] != "--check":
        raise SystemExit("usage: python benchmarks/gpu_report.py --check FOLDER [RUN_FOLDER...]")
    if sys.argv[3:]:  # the runs' reports first, merged into FOLDER/gpu_throughput.*
        merge(sys.argv[3:], sys.argv[2])
    print(check_report(sys.argv[2]))
