"""Scheduler overhead of two source trees side by side on this CPU: each tree's own
`benchmarks/test_scheduler_overhead.py` (one decode step's bookkeeping with 256
running sequences: schedule, the model runner's prepare, update; a stub model),
run from a copy of the tree's source folders (`cpu_ab.mapped_copy`), pinned to one
core, A B B A `--repeats` times. Printed per case: each side's median us/step over
its runs, and B/A with a paired bootstrap interval over the repeats
(`servelab.lab.stats`).

    python benchmarks/overhead_ab.py --before ../servelab-before --core 1 --repeats 4
    python benchmarks/overhead_ab.py --before ../servelab-before -k continuous
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from cpu_ab import ORDER, git_commit, mapped_copy

HERE = Path(__file__).resolve().parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", type=Path, required=True, help="tree A: a checkout (worktree)")
    p.add_argument("--after", type=Path, default=HERE.parent, help="tree B (default: this tree)")
    p.add_argument("--core", type=int, default=1, help="the one CPU every run is pinned to")
    p.add_argument("--repeats", type=int, default=4, help="A B B A rounds (default 4)")
    p.add_argument("-k", default="continuous", help="pytest -k: which cases (default continuous)")
    p.add_argument("--smoke", action="store_true", help="16 sequences, 3 steps: does it run")
    return p.parse_args(argv)


def run_side(args, tree: Path, site: Path, out: Path) -> dict[str, float]:
    """us/step (median of the run's steps) of each case of `tree`'s benchmark."""
    # a clean pytest: none of a calling pytest's variables (an xdist worker's included)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["PYTHONPATH"] = f"{site}{os.pathsep}{tree / 'benchmarks'}"
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    if args.smoke:
        env["SERVELAB_BENCH_SMOKE"] = "1"
    command = ["taskset", "-c", str(args.core), sys.executable, "-m", "pytest", "-q",
               "-p", "no:cacheprovider", "-p", "no:xdist", "-o", "addopts=", "-k", args.k,
               str(tree / "benchmarks" / "test_scheduler_overhead.py"),
               f"--benchmark-json={out}"]  # fmt: skip
    done = subprocess.run(command, env=env, cwd=tree, capture_output=True, text=True)
    if done.returncode != 0:
        sys.stderr.write(done.stdout[-3000:] + done.stderr[-3000:])
        raise SystemExit(f"the benchmark of {tree} failed with exit {done.returncode}")
    found = json.loads(out.read_text())["benchmarks"]
    return {b["param"] or b["name"]: b["stats"]["median"] * 1e6 for b in found}


def main(argv: list[str] | None = None) -> int:
    from servelab.lab.stats import interval_text, ratio_estimate

    args = parse_args(argv)
    trees = {"A": args.before.resolve(), "B": args.after.resolve()}
    for side, tree in trees.items():
        print(f"{side}: {tree} ({git_commit(tree)})")
    print(f"core {args.core}, {args.repeats} x A B B A, cases -k {args.k!r}")
    runs: dict[str, list[dict[str, float]]] = {"A": [], "B": []}
    with tempfile.TemporaryDirectory(prefix="servelab-overhead-ab-") as tmp:
        sites = {s: mapped_copy(t, Path(tmp) / s) for s, t in trees.items()}
        for _ in range(args.repeats):
            for i, side in enumerate(ORDER):
                out = Path(tmp) / f"{side}-{len(runs[side])}-{i}.json"
                runs[side].append(run_side(args, trees[side], sites[side], out))
    for case in sorted(runs["A"][0]):
        a = [r[case] for r in runs["A"]]
        b = [r[case] for r in runs["B"]]
        # a repeat's two runs of one side, averaged: the pairs the bootstrap resamples
        pairs = [
            ((b[2 * i] + b[2 * i + 1]) / 2, (a[2 * i] + a[2 * i + 1]) / 2)
            for i in range(args.repeats)
        ]
        ratio = ratio_estimate([p[0] for p in pairs], [p[1] for p in pairs], paired=True)
        print(f"{case}: A {statistics.median(a):.1f} us/step, B {statistics.median(b):.1f} "
              f"us/step, B/A {ratio.mean:.3f}x {interval_text(ratio)} "
              f"({len(a)} runs a side)")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
