"""How long `servelab-report` takes over one multirun folder, for two source
trees side by side: tree A (before) and tree B (after, by default the tree
holding this script), each run a fresh process that imports its own tree
(mapped onto PYTHONPATH as `cpu_ab.py` maps it), in the order A B B A so a
busy spell of the machine falls on both alike. Each side writes into its own
temporary folder; the run folders are only read.

Printed: every run's seconds with the machine's load average and the share of
the CPUs other processes used meanwhile, then each side's mean. Make the folder
once and reuse it, e.g. the 48 runs of `continuous_vs_static`:

    servelab -m experiment=continuous_vs_static hydra.sweep.dir=/tmp/cvs48 run.progress=false
    python benchmarks/report_speed.py /tmp/cvs48 --before ../servelab-before
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from cpu_ab import git_commit, mapped_copy  # noqa: E402

WORKER = """
import json, sys, time
started = time.perf_counter()
from servelab.lab.report import write_report
imported = time.perf_counter()
write_report([sys.argv[1]], sys.argv[2])
done = time.perf_counter()
print("REPORT_SPEED " + json.dumps({"import_s": imported - started, "report_s": done - imported}))
"""


def cpu_seconds() -> tuple[float, float]:
    """The machine's (busy, total) CPU seconds so far, every core (/proc/stat)."""
    ticks = [float(v) for v in Path("/proc/stat").read_text().split("\n")[0].split()[1:9]]
    hz = os.sysconf("SC_CLK_TCK")
    return (sum(ticks) - ticks[3] - ticks[4]) / hz, sum(ticks) / hz


def run_side(side: str, site: Path, folder: Path, timeout: float) -> dict:
    out = Path(tempfile.mkdtemp(prefix=f"report-{side}-"))
    env = dict(os.environ, PYTHONPATH=str(site))
    busy0, total0 = cpu_seconds()
    load = os.getloadavg()[0]
    child = subprocess.run([sys.executable, "-c", WORKER, str(folder), str(out)], env=env,
                           capture_output=True, text=True, timeout=timeout, check=False)  # fmt: skip
    busy1, total1 = cpu_seconds()
    lines = [line for line in child.stdout.splitlines() if line.startswith("REPORT_SPEED ")]
    if child.returncode != 0 or not lines:
        sys.stderr.write(child.stdout[-2000:] + child.stderr[-4000:])
        raise SystemExit(f"the report of tree {side} failed with exit {child.returncode}")
    result = json.loads(lines[-1][len("REPORT_SPEED ") :])
    # the report's own process counts as busy too: the machine's share, all of it
    result.update(side=side, load_average=load, busy_pct=100 * (busy1 - busy0) / (total1 - total0),
                  out=str(out))  # fmt: skip
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", type=Path, help="a multirun folder (made once, reused)")
    p.add_argument("--before", type=Path, required=True, help="tree A: the servelab before")
    p.add_argument("--after", type=Path, default=HERE.parent, help="tree B (default: this one)")
    p.add_argument("--order", default="ABBA", help="the sides in run order (default ABBA)")
    p.add_argument("--timeout", type=float, default=1800)
    args = p.parse_args(argv)
    runs = sum(1 for _ in args.folder.rglob("results.json"))
    print(f"report of {args.folder} ({runs} runs); A = {args.before} ({git_commit(args.before)}), "
          f"B = {args.after} ({git_commit(args.after)}); {os.cpu_count()} CPUs")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        sites = {side: mapped_copy(tree, Path(tmp) / side)
                 for side, tree in (("A", args.before), ("B", args.after))}  # fmt: skip
        results = []
        for side in args.order:
            result = run_side(side, sites[side], args.folder, args.timeout)
            results.append(result)
            print(f"{side}: report {result['report_s']:.1f} s (+ import {result['import_s']:.1f} s); "
                  f"load average {result['load_average']:.1f}, machine busy "
                  f"{result['busy_pct']:.0f}%  -> {result['out']}", flush=True)  # fmt: skip
    for side in dict.fromkeys(args.order):
        times = [r["report_s"] for r in results if r["side"] == side]
        print(f"{side}: mean {sum(times) / len(times):.1f} s over {len(times)} runs "
              f"({', '.join(f'{t:.1f}' for t in times)})")  # fmt: skip
    return 0


if __name__ == "__main__":
    started = time.time()
    code = main()
    print(f"benchmark: {time.time() - started:.0f} s")
    raise SystemExit(code)
