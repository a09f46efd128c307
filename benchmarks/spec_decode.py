"""Speculative decoding on the trained pair (benchmarks/spec_pair.py): output
tok/s of each proposer beside no speculation, at batch sizes 1, 8 and 32, on
the pair's two workloads (code completion, and a copy-heavy code edit), with
each proposer's mean accepted length and acceptance.

    python benchmarks/spec_decode.py [--pair DIR] [--repeats 5] [--batches 1 8 32]
        [--proposers none ngram draft] [--requests 8] [--temperature 0] [--out results.json]

One engine per proposer and batch size, built once and warmed; then every repeat runs every
(workload, batch size) with every proposer in turn, the proposers' order
rotated each repeat, so a busy spell of the machine hits all alike. A batch of
B runs `requests * max(1, B / 8)` requests with `max_num_seqs = B`,
submitted together (batch 1 serves them one after another), `max_tokens` from the
workload, greedy (or, with `--temperature T`, sampled at T, request i seeded with i).
Ratios against `none` are paired by repeat (the runs beside each other), with 95%
intervals (`servelab.lab.stats.ratio_estimate`). Outputs must equal `none`'s (greedy,
or seeded with point-mass drafts); the script says if one does not. `draft_sampled`
(the draft model drawing drafts at the request's sampling, verified by rejection
sampling) is left out of that check when sampling: its seeded tokens differ by design.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from servelab import LLM, SamplingParams
from servelab.lab.provenance import cpu_model
from servelab.lab.stats import interval_text, mean_estimate, ratio_estimate

CACHE = Path.home() / ".cache" / "servelab" / "spec_pair"
WORKLOADS = ("code_completion", "code_edit")


def proposer_nodes(pair: Path) -> dict[str, dict | str]:
    return {
        "none": "none",
        "ngram": {"name": "ngram", "k": 5, "min_n": 2, "max_n": 4},  # = conf/proposer/pair_ngram.yaml
        "draft": {"name": "draft", "model": str(pair / "draft"), "k": 4},
        "draft_sampled": {"name": "draft", "model": str(pair / "draft"), "k": 4,
                          "draft_sampling": "request"},
        "eagle": {"name": "eagle", "model": str(pair / "eagle"), "k": 4},
    }


def latest_pair() -> Path:
    runs = [
        p for p in CACHE.glob("*") if (p / "manifest.json").exists() and (p / "target").is_dir()
    ]
    if not runs:
        sys.exit(f"no trained pair in {CACHE}: run `python benchmarks/spec_pair.py train` first")
    return max(runs, key=lambda p: (p / "manifest.json").stat().st_mtime)


def load_workload(pair: Path, name: str) -> list[dict]:
    lines = (pair / "workloads" / f"{name}.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def build(pair: Path, proposer, max_num_seqs: int, threads: int) -> LLM:
    return LLM(
        model={"path": str(pair / "target")},
        proposer=proposer,
        allocator={"name": "paged", "block_size": 16, "prefix_caching": False},
        max_model_len=640,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=2048,
        kv_cache_memory="96MiB",
        num_threads=threads,
    )


def run_once(llm: LLM, requests: list[dict], ignore_eos: bool = False,
             temperature: float = 0.0) -> dict:  # fmt: skip
    before = dict(llm.engine.scheduler.stats())
    prompts = [r["prompt_token_ids"] for r in requests]
    params = [SamplingParams(temperature=temperature, max_tokens=r["max_tokens"],
                             ignore_eos=ignore_eos, seed=i if temperature > 0 else None)
              for i, r in enumerate(requests)]  # fmt: skip
    begin = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - begin
    after = llm.engine.scheduler.stats()

    def delta(key: str) -> float:
        return after.get(key, 0) - before.get(key, 0)

    tokens = sum(len(o.token_ids) for o in outputs)
    verifications = delta("spec_num_drafts")
    return {
        "tokens": [o.token_ids for o in outputs],
        "output_tok_s": tokens / seconds,
        "seconds": seconds,
        "verifications": verifications,
        "accepted": delta("spec_num_accepted_tokens"),
        "mean_accepted_length": 1 + delta("spec_num_accepted_tokens") / verifications
        if verifications
        else None,
        "acceptance": delta("spec_num_accepted_tokens") / delta("spec_num_draft_tokens")
        if delta("spec_num_draft_tokens")
        else None,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pair", type=Path, default=None)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--proposers", nargs="+", default=["none", "ngram", "draft", "eagle"])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS))
    parser.add_argument("--requests", type=int, default=8, help="requests of a batch-8 run")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    pair = args.pair or latest_pair()
    nodes = proposer_nodes(pair)
    if "none" not in args.proposers:
        args.proposers.insert(0, "none")
    engines = {}  # one per (proposer, batch size), warmed
    for name in args.proposers:
        for batch in args.batches:
            llm = engines[name, batch] = build(pair, nodes[name], batch, args.threads)
            llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=4))
    workloads = {w: load_workload(pair, w) for w in args.workloads}
    cells = [(w, b) for w in args.workloads for b in args.batches]
    runs: dict[str, list[dict]] = {}
    for repeat in range(args.repeats):
        order = (
            args.proposers[repeat % len(args.proposers) :]
            + args.proposers[: repeat % len(args.proposers)]
        )
        for workload, batch in cells:
            count = args.requests * max(1, batch // 8)  # batch 1: the requests one by one
            requests = workloads[workload][:count]
            for name in order:
                result = run_once(engines[name, batch], requests,
                                  temperature=args.temperature)  # fmt: skip
                runs.setdefault(f"{workload}|{batch}|{name}", []).append(result)
            print(f"repeat {repeat + 1}/{args.repeats}: {workload} batch {batch} done", flush=True)
    table = summarise(runs, cells, args.proposers, sampled=args.temperature > 0)
    report = {"cpu": cpu_model(), "pair": str(pair), "repeats": args.repeats, "rows": table,
              "temperature": args.temperature,
              "command": " ".join(["python", "benchmarks/spec_decode.py", *(argv or sys.argv[1:])])}  # fmt: skip
    print(markdown(report))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))
    return report


def summarise(runs: dict[str, list[dict]], cells, proposers, sampled: bool = False
              ) -> list[dict]:  # fmt: skip
    rows = []
    for workload, batch in cells:
        base = runs[f"{workload}|{batch}|none"]
        for name in proposers:
            mine = runs[f"{workload}|{batch}|{name}"]
            speed = [r["output_tok_s"] for r in mine]
            ratio = ratio_estimate(speed, [r["output_tok_s"] for r in base], paired=True)
            lengths = [r["mean_accepted_length"] for r in mine if r["mean_accepted_length"]]
            accept = [r["acceptance"] for r in mine if r["acceptance"] is not None]
            rows.append({
                "workload": workload, "batch": batch, "proposer": name,
                "output_tok_s": mean_estimate(speed).mean,
                "output_tok_s_ci": interval_text(mean_estimate(speed)),
                "ratio_vs_none": ratio.mean, "ratio_ci": interval_text(ratio),
                "mean_accepted_length": sum(lengths) / len(lengths) if lengths else None,
                "acceptance_pct": 100 * sum(accept) / len(accept) if accept else None,
                "same_tokens_as_none": None if sampled and name == "draft_sampled"
                else all(r["tokens"] == b["tokens"] for r, b in zip(mine, base)),
            })  # fmt: skip
    return rows


SAME = {True: "yes", False: "NO", None: "- (sampled drafts)"}


def markdown(report: dict) -> str:
    lines = [
        f"CPU: {report['cpu']}; {report['repeats']} repeats; pair {report['pair']}; "
        f"temperature {report.get('temperature', 0.0)}",
        "",
        "| workload | batch | proposer | output tok/s [95% CI] | vs none [95% CI] "
        "| mean accepted length | acceptance | same tokens |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        length = f"{r['mean_accepted_length']:.2f}" if r["mean_accepted_length"] else "-"
        accept = f"{r['acceptance_pct']:.0f}%" if r["acceptance_pct"] is not None else "-"
        lines.append(
            f"| {r['workload']} | {r['batch']} | {r['proposer']} | {r['output_tok_s']:.0f} "
            f"{r['output_tok_s_ci']} | {r['ratio_vs_none']:.2f}x {r['ratio_ci']} | {length} "
            f"| {accept} | {SAME[r['same_tokens_as_none']]} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
