"""Output tok/s of two source trees side by side on this CPU: tree A (before) and
tree B (after, by default the tree holding this script) serve the reference workload
(`reference_workload.py`: the `bench` model, 64 requests, all at once, greedy,
float32) offline, each run a fresh process pinned to one core with a fixed torch
thread count.

Runs alternate A B B A, `--repeats` times, so a slow spell of the machine falls on
both sides alike (and a linear drift within a repeat cancels). Printed: each side's
output tok/s mean with its 95% interval, and B/A with a paired bootstrap interval
over the repeats (`servelab.lab.stats`); every run's token digest must be the same
on both sides, or the script fails: a faster tree that serves other tokens is no
comparison. A tree runs from a copy of its source folders mapped as `setup.py`
maps them, on PYTHONPATH, so both sides import their own code in the same way and
share one environment.

    python benchmarks/cpu_ab.py --before ../servelab-before --core 1 --repeats 5
    python benchmarks/cpu_ab.py --before ../servelab-before --core 0 --smoke   # does it run?
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# setup.py's mapping: source folder -> where it lands under the import root
FOLDERS = {"core": "servelab", "plugins": "servelab/plugins", "conf": "servelab/conf"}
ORDER = ("A", "B", "B", "A")  # one repeat


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", type=Path, help="tree A: a checkout (worktree); required")
    p.add_argument("--after", type=Path, default=HERE.parent, help="tree B (default: this tree)")
    p.add_argument("--core", type=int, default=1, help="the one CPU every run is pinned to")
    p.add_argument("--threads", type=int, default=1, help="torch threads per run (default 1)")
    p.add_argument("--repeats", type=int, default=5, help="A B B A rounds (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs per side first")
    p.add_argument(
        "--parts",
        default="{}",
        help="JSON of parts (and an `engine` node) over the preset's, e.g. "
        '\'{"attention": {"name": "flash_varlen", "impl": "cpu"}}\'',
    )
    p.add_argument("--smoke", action="store_true", help="a few tiny requests: does it run")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    p.add_argument("--json", type=Path, help="write every run and the estimates here")
    p.add_argument("--worker", choices=("A", "B"), help=argparse.SUPPRESS)
    p.add_argument("--site", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--tree", type=Path, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# -- one run, in its own process


def digest(outputs: dict[str, list[int]]) -> str:
    """The same digest as the end-to-end benchmark's: equal digests, equal tokens."""
    text = json.dumps(sorted(outputs.items()), separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def worker(args: argparse.Namespace) -> None:
    """One timed run of the reference workload from `args.site`; prints one JSON line."""
    os.sched_setaffinity(0, {args.core})  # first: torch's OpenMP threads inherit it
    sys.path.insert(0, str(args.tree / "benchmarks"))  # the tree's own workload definition
    import reference_workload
    import torch

    import servelab

    loaded = Path(servelab.__file__).resolve()
    if args.site.resolve() not in loaded.parents:
        raise SystemExit(f"servelab came from {loaded}, not from the copy at {args.site}")
    parts = json.loads(args.parts)
    engine_node = {**parts.pop("engine", {}), "num_threads": args.threads}
    config = reference_workload.reference_config(**parts, engine=engine_node)
    engine, requests = reference_workload.prepared_engine(config)
    result = reference_workload.serve_all(engine, requests)
    record = dict(
        side=args.worker,
        output_tok_s=result.output_tok_s,
        wall_s=result.wall_s,
        output_tokens=result.output_tokens,
        requests=len(result.outputs),
        digest=digest(result.outputs),
        threads=torch.get_num_threads(),
        cpus=sorted(os.sched_getaffinity(0)),
    )
    print("CPU_AB " + json.dumps(record), flush=True)


# -- the side-by-side


def mapped_copy(tree: Path, root: Path) -> Path:
    """`tree`'s source folders copied under `root` as setup.py maps them."""
    for folder, target in FOLDERS.items():
        if not (tree / folder).is_dir():
            raise SystemExit(f"{tree} has no {folder}/: not a servelab tree")
        ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
        shutil.copytree(tree / folder, root / target, ignore=ignore, dirs_exist_ok=True)
    return root


def git_commit(tree: Path) -> str:
    done = subprocess.run(
        ["git", "-C", str(tree), "describe", "--always", "--dirty"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    return done.stdout.strip() or "unknown"


def run_side(args, side: str, tree: Path, site: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(site))
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env[name] = str(args.threads)
    if args.smoke:
        env["SERVELAB_BENCH_SMOKE"] = "1"
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", side]
    command += ["--site", str(site), "--tree", str(tree), "--core", str(args.core)]
    command += ["--threads", str(args.threads), "--parts", args.parts]
    done = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=args.timeout, check=False
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("CPU_AB ")]
    if done.returncode != 0 or not lines:
        sys.stderr.write(done.stdout[-2000:] + done.stderr[-4000:])
        raise SystemExit(f"the run of tree {side} ({tree}) failed with exit {done.returncode}")
    return json.loads(lines[-1][len("CPU_AB ") :])


def summarize(runs: list[dict], repeats: int) -> dict:
    from servelab.lab.stats import interval_text, mean_estimate, ratio_estimate, rounded

    def rates(side: str) -> list[float]:
        return [r["output_tok_s"] for r in runs if r["side"] == side]

    def per_repeat(side: str) -> list[float]:  # a repeat's two runs of one side, averaged
        values = rates(side)
        return [sum(values[2 * i : 2 * i + 2]) / 2 for i in range(repeats)]

    sides = {s: mean_estimate(rates(s)) for s in ("A", "B")}
    ratio = ratio_estimate(per_repeat("B"), per_repeat("A"), paired=True)
    summary = {"sides": {}, "ratio": {}}
    for side, est in sides.items():
        summary["sides"][side] = dict(
            mean=est.mean, low=est.low, high=est.high, n=est.n, text=rounded(est)
        )
        print(f"{side}: {rounded(est)} output tok/s  {interval_text(est)}  ({est.n} runs)")
    summary["ratio"] = dict(mean=ratio.mean, low=ratio.low, high=ratio.high, n=ratio.n)
    print(f"B/A: {ratio.mean:.4f}x  {interval_text(ratio)}  (paired over {ratio.n} repeats)")
    return summary


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.before is None:
        raise SystemExit("--before TREE is required: the tree to compare this one with")
    if not 0 <= args.core < (os.cpu_count() or 1):
        raise SystemExit(f"no CPU {args.core} here (CPUs 0..{(os.cpu_count() or 1) - 1})")
    if args.threads > 1:
        print(f"note: {args.threads} threads share one core: they take turns", file=sys.stderr)
    json.loads(args.parts)  # a typo fails here, not in every run
    trees = {"A": args.before.resolve(), "B": args.after.resolve()}
    print(f"A: {trees['A']} ({git_commit(trees['A'])})")
    print(f"B: {trees['B']} ({git_commit(trees['B'])})")
    print(f"core {args.core}, {args.threads} torch thread(s), {args.repeats} x A B B A")
    runs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="servelab-cpu-ab-") as tmp:
        sites = {s: mapped_copy(t, Path(tmp) / s) for s, t in trees.items()}
        for _ in range(args.warmup):  # C++ kernels built into the cache, files read once
            for side in ("A", "B"):
                run_side(args, side, trees[side], sites[side])
        for repeat in range(args.repeats):
            for side in ORDER:
                begin = time.perf_counter()
                record = run_side(args, side, trees[side], sites[side])
                record["repeat"] = repeat
                runs.append(record)
                print(
                    f"  repeat {repeat} {side}: {record['output_tok_s']:,.1f} tok/s "
                    f"({record['output_tokens']} tokens in {record['wall_s']:.2f} s; "
                    f"process {time.perf_counter() - begin:.1f} s) digest {record['digest']}",
                    flush=True,
                )
    pinned = {(tuple(r["cpus"]), r["threads"]) for r in runs}
    if pinned != {((args.core,), args.threads)}:
        raise SystemExit(f"runs were not pinned as asked: (cpus, threads) {sorted(pinned)}")
    summary = summarize(runs, args.repeats)
    digests = {(r["side"], r["digest"]) for r in runs}
    same = len({d for _, d in digests}) == 1
    print("token digests: " + ("identical" if same else f"DIFFER {sorted(digests)}"))
    if args.json:
        args.json.write_text(
            json.dumps(
                dict(trees={s: str(t) for s, t in trees.items()}, runs=runs, **summary), indent=1
            )
        )
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
