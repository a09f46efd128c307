"""Speculative decoding side by side with vLLM's CPU backend: servelab and vLLM, each
without speculation and with n-gram lookup, on the trained pair's target model
(benchmarks/spec_pair.py, the same model files) and the same requests.

    python benchmarks/spec_vllm_peer.py --vllm-python /work/venvs/vllm/bin/python \
        [--pair DIR] [--repeats 5] [--batches 1 8] [--requests 8] [--out results.json]

Each system runs one process per batch size, started once, holding one engine per
proposer, built and warmed there (one vLLM engine's Prometheus metrics replace the
previous one's in a process, so the n-gram engine is built last): vLLM as it runs by
default (compiled), float32. n-gram
lookup is configured alike: up to 5 drafts after the earliest occurrence of the longest
2- to 4-token match in the request's own tokens (servelab: `match: earliest`) (vLLM: `speculative_config={"method": "ngram", "num_speculative_tokens": 5,
"prompt_lookup_min": 2, "prompt_lookup_max": 4}`). Requests are greedy with `ignore_eos`,
so both systems produce the workload's `max_tokens` for every request. A batch of B runs
`requests * max(1, B / 8)` requests with `max_num_seqs = B`, all submitted together.

Every repeat runs every (workload, batch size, proposer) on both systems, the systems'
order alternating by repeat and the proposers' order rotated, while the other process
waits idle. Ratios are paired by repeat with 95% intervals. Each row says whether
n-gram's tokens equal no speculation's on that system, and how many of the tokens the
two systems give agree (float32 rounding differs between their kernels, so a random
near-tie may go either way).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))

PROPOSERS = ("none", "ngram")
# vLLM drafts after the earliest occurrence of the longest match: servelab's `match: earliest`
NGRAM = {"k": 5, "min_n": 2, "max_n": 4, "match": "earliest"}
VLLM_NGRAM = {"method": "ngram", "num_speculative_tokens": NGRAM["k"],
              "prompt_lookup_min": NGRAM["min_n"], "prompt_lookup_max": NGRAM["max_n"]}  # fmt: skip
MAX_MODEL_LEN = 640  # spec_decode.py's engines


# -- the workers: one process per system, answering one JSON line per cell asked


def servelab_engines(pair: Path, batches: list[int], threads: int) -> dict:
    from spec_decode import build

    from servelab import SamplingParams

    engines = {}
    for proposer in PROPOSERS:
        node = "none" if proposer == "none" else {"name": "ngram", **NGRAM}
        for batch in batches:
            llm = engines[proposer, batch] = build(pair, node, batch, threads)
            llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=4))
    return engines


def servelab_run(llm, requests: list[dict]) -> dict:
    from spec_decode import run_once

    return run_once(llm, requests, ignore_eos=True)  # as vLLM is asked


def vllm_engines(pair: Path, batches: list[int], threads: int) -> dict:
    from vllm import LLM, SamplingParams

    engines = {}
    for proposer in PROPOSERS:
        extra = {} if proposer == "none" else {"speculative_config": dict(VLLM_NGRAM)}
        for batch in batches:
            llm = engines[proposer, batch] = LLM(
                model=str(pair / "target"), dtype="float32", skip_tokenizer_init=True,
                max_model_len=MAX_MODEL_LEN, max_num_seqs=batch, seed=0,
                disable_log_stats=False, **extra,
            )  # fmt: skip
            warm = SamplingParams(max_tokens=4, temperature=0.0, detokenize=False)
            llm.generate([{"prompt_token_ids": [1, 2, 3]}], warm, use_tqdm=False)
    return engines


def _vllm_counters(llm) -> dict[str, float]:
    counters = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode_num_") and hasattr(metric, "value"):
            counters[metric.name] = counters.get(metric.name, 0) + metric.value
    return counters


def vllm_run(llm, requests: list[dict]) -> dict:
    from vllm import SamplingParams

    before = _vllm_counters(llm)
    params = [SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True,
                             detokenize=False) for r in requests]  # fmt: skip
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": r["prompt_token_ids"]} for r in requests],
                           params, use_tqdm=False)  # fmt: skip
    seconds = time.perf_counter() - start
    after = _vllm_counters(llm)

    def delta(name: str) -> float:
        return after.get(f"vllm:spec_decode_num_{name}", 0) - before.get(
            f"vllm:spec_decode_num_{name}", 0
        )

    return {"seconds": seconds, "tokens": [list(o.outputs[0].token_ids) for o in outputs],
            "verifications": delta("drafts"), "accepted": delta("accepted_tokens")}  # fmt: skip


def worker(system: str, pair: Path, batches: list[int], threads: int) -> None:
    if system == "vllm":
        try:
            import torchvision  # noqa: F401
        except Exception:  # built for another torch: a text model needs none
            for name in [m for m in sys.modules if m.startswith("torchvision")]:
                del sys.modules[name]
            sys.modules["torchvision"] = None  # type: ignore[assignment]
    engines = (vllm_engines if system == "vllm" else servelab_engines)(pair, batches, threads)
    run = vllm_run if system == "vllm" else servelab_run
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:  # the requests come from the driver: the vLLM venv has no servelab
        ask = json.loads(line)
        if "requests" not in ask:
            break
        print(json.dumps(run(engines[ask["proposer"], ask["batch"]], ask["requests"])), flush=True)


# -- the driver


class Worker:
    """One system's worker process; `ask` sends one cell and reads its answer."""

    def __init__(self, system: str, python: str, args, batch: int, log: Path) -> None:
        command = [python, str(HERE), "--worker", system, "--pair", str(args.pair),
                   "--threads", str(args.threads), "--batches", str(batch)]  # fmt: skip
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), VLLM_CPU_KVCACHE_SPACE="1")
        self.log = open(log, "w")  # noqa: SIM115 (open while the worker runs)
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=self.log, text=True, env=env)  # fmt: skip
        self.system = system
        self._read()  # ready: its engines are built and warm

    def _read(self) -> dict:
        while True:
            line = self.process.stdout.readline()
            if not line:
                raise RuntimeError(f"the {self.system} worker stopped; see {self.log.name}")
            if line.startswith("{"):
                return json.loads(line)

    def ask(self, batch: int, proposer: str, requests: list[dict]) -> dict:
        cell = {"batch": batch, "proposer": proposer, "requests": requests}
        self.process.stdin.write(json.dumps(cell) + "\n")
        self.process.stdin.flush()
        return self._read()

    def close(self) -> None:
        try:
            self.process.stdin.write("{}\n")
            self.process.stdin.close()
            self.process.wait(timeout=120)
        except (OSError, subprocess.TimeoutExpired):
            self.process.kill()
        self.log.close()


def summarise(runs: dict[tuple, list[dict]], cells: list[tuple[str, int]]) -> list[dict]:
    from servelab.lab.stats import interval_text, mean_estimate, ratio_estimate

    def rate(run: dict) -> float:
        return sum(map(len, run["tokens"])) / run["seconds"]

    rows = []
    for workload, batch in cells:
        for proposer in PROPOSERS:
            mine, theirs = (
                runs["servelab", workload, batch, proposer],
                runs["vllm", workload, batch, proposer],
            )
            row = {"workload": workload, "batch": batch, "proposer": proposer}
            for system, results in (("servelab", mine), ("vllm", theirs)):
                speed = [rate(r) for r in results]
                plain = [rate(r) for r in runs[system, workload, batch, "none"]]
                vs_none = ratio_estimate(speed, plain, paired=True)
                verifications = sum(r["verifications"] for r in results)
                accepted = sum(r["accepted"] for r in results)
                row[system] = {
                    "output_tok_s": mean_estimate(speed).mean,
                    "output_tok_s_ci": interval_text(mean_estimate(speed)),
                    "vs_none": vs_none.mean, "vs_none_ci": interval_text(vs_none),
                    "mean_accepted_length": 1 + accepted / verifications if verifications else None,
                    "same_tokens_as_none": all(r["tokens"] == p["tokens"] for r, p in
                                               zip(results, runs[system, workload, batch, "none"])),
                }  # fmt: skip
            ratio = ratio_estimate([rate(r) for r in mine], [rate(r) for r in theirs], paired=True)
            pairs = [(a, b) for r, s in zip(mine, theirs) for x, y in zip(r["tokens"], s["tokens"])
                     for a, b in zip(x, y)]  # fmt: skip
            row["servelab_vs_vllm"], row["servelab_vs_vllm_ci"] = ratio.mean, interval_text(ratio)
            row["token_agreement"] = sum(a == b for a, b in pairs) / len(pairs)
            rows.append(row)
    return rows


def markdown(report: dict) -> str:
    lines = [
        f"CPU: {report['cpu']}; {report['repeats']} repeats, systems alternating; pair {report['pair']}",
        "",
        "| workload | batch | proposer | servelab tok/s | vs none | accepted length "
        "| vLLM tok/s | vs none | accepted length | servelab / vLLM | same tokens as none (servelab, vLLM) | tokens agreeing |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        cells = []
        for system in ("servelab", "vllm"):
            s = r[system]
            length = f"{s['mean_accepted_length']:.2f}" if s["mean_accepted_length"] else "-"
            cells += [f"{s['output_tok_s']:.0f} {s['output_tok_s_ci']}",
                      f"{s['vs_none']:.2f}x {s['vs_none_ci']}", length]  # fmt: skip
        same = ", ".join(
            "yes" if r[s]["same_tokens_as_none"] else "NO" for s in ("servelab", "vllm")
        )
        lines.append(f"| {r['workload']} | {r['batch']} | {r['proposer']} | " + " | ".join(cells)
                     + f" | {r['servelab_vs_vllm']:.2f}x {r['servelab_vs_vllm_ci']} | {same} "
                     f"| {100 * r['token_agreement']:.1f}% |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-python", help="a python with vllm installed")
    parser.add_argument("--pair", type=Path, default=None)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--workloads", nargs="+", default=["code_completion", "code_edit"])
    parser.add_argument("--requests", type=int, default=8, help="requests of a batch-8 run")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--worker", choices=("servelab", "vllm"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.pair, args.batches, args.threads)
        return None
    if not args.vllm_python:
        parser.error("--vllm-python is required: a python with vllm installed")
    from spec_decode import latest_pair, load_workload

    from servelab.lab.provenance import cpu_model

    args.pair = args.pair or latest_pair()
    workloads = {w: load_workload(args.pair, w) for w in args.workloads}

    logs = Path(args.out.parent if args.out else ".")
    pythons = {"servelab": sys.executable, "vllm": args.vllm_python}
    workers = {(system, batch): Worker(system, python, args, batch,
                                       logs / f"spec_vllm_peer_{system}_{batch}.log")
               for system, python in pythons.items() for batch in args.batches}  # fmt: skip
    cells = [(w, b) for w in args.workloads for b in args.batches]
    runs: dict[tuple, list[dict]] = {}
    try:
        for repeat in range(args.repeats):
            systems = ("servelab", "vllm") if repeat % 2 == 0 else ("vllm", "servelab")
            order = PROPOSERS[repeat % 2 :] + PROPOSERS[: repeat % 2]
            for workload, batch in cells:
                count = args.requests * max(1, batch // 8)
                requests = [{"prompt_token_ids": r["prompt_token_ids"], "max_tokens": r["max_tokens"]}
                            for r in workloads[workload][:count]]  # fmt: skip
                for proposer in order:
                    for system in systems:
                        result = workers[system, batch].ask(batch, proposer, requests)
                        runs.setdefault((system, workload, batch, proposer), []).append(result)
            print(f"repeat {repeat + 1}/{args.repeats} done", flush=True)
    finally:
        for w in workers.values():
            w.close()
    report = {"cpu": cpu_model(), "pair": str(args.pair), "repeats": args.repeats,
              "rows": summarise(runs, cells),
              "command": " ".join(["python", "benchmarks/spec_vllm_peer.py", *(argv or sys.argv[1:])])}  # fmt: skip
    print(markdown(report))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
