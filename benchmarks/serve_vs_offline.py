"""Throughput through the server against the offline engine on the reference
workload (64 requests at once), each side in its own fresh process.

Offline: `EngineLoop(engine).generate` (what `LLM.generate` runs; `--offline serve_all` for
the bare step loop) on a built, warmed-up engine. Server: `servelab serve`'s app
on uvicorn, driven by one streaming HTTP client per request (64 concurrent),
all in one process, so the clients' cost is on the same CPU as the engine's.
The sides alternate (offline, server, server, offline, ...) for `--repeats`
pairs, pinned to `--cpu` with `--threads` torch threads. Printed: output tok/s
of both (mean and 95% interval over the repeats), the server/offline ratio with
the paired bootstrap interval of `servelab.lab.stats.ratio_estimate` (repeat i
of both sides ran beside each other, so a busy spell cancels), and the median
over requests of the time to first token the server added (client-measured
TTFT minus the same request's offline TTFT, paired within a repeat). Exits 1
unless every stream got exactly the offline tokens.

With `--client-cpu C` the clients run in their own process on CPU C and the server
alone on `--cpu`, as a load generator on another machine would drive it: the
server then has exactly the CPU the offline side has.

    python benchmarks/serve_vs_offline.py --repeats 5 --cpu 1 --threads 1 [--json out.json]
    python benchmarks/serve_vs_offline.py --repeats 5 --cpu 1 --client-cpu 0 --threads 1
    SERVELAB_BENCH_SMOKE=1 ...: a handful of short requests, a check that it runs
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
SIDES = ("offline", "server")


def order(repeats: int) -> list[str]:
    """offline, server, server, offline, offline, server, ...: neither side always first."""
    pairs = [SIDES if r % 2 == 0 else SIDES[::-1] for r in range(repeats)]
    return [side for pair in pairs for side in pair]


# -- the clients


async def stream(client, url: str, req) -> tuple[list[int], float]:
    p = req.params
    body = {"prompt": req.prompt_token_ids, "max_tokens": p.max_tokens, "stream": True,
            "temperature": p.temperature, "ignore_eos": p.ignore_eos}  # fmt: skip
    start, first, tokens = time.perf_counter(), None, []
    async with client.stream("POST", url, json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            choices = json.loads(line[6:]).get("choices") or []
            if choices and choices[0].get("token_ids"):
                first = first or time.perf_counter()
                tokens += choices[0]["token_ids"]
    return tokens, first - start


async def drive_clients(url: str, requests) -> tuple[list, float]:
    """One streaming client per request, all at once (after one untimed request)."""
    import asyncio

    import httpx

    limits = httpx.Limits(max_connections=len(requests), max_keepalive_connections=len(requests))
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await stream(client, url, requests[0])  # the first HTTP request's one-off costs, untimed
        start = time.perf_counter()
        results = await asyncio.gather(*(stream(client, url, r) for r in requests))
        return results, time.perf_counter() - start


# -- one side, in a fresh process


def run_side(side: str, threads: int | None, offline_mode: str, server_cpu=None) -> dict:
    """Runs one side once; output tokens, wall time and per-request tokens and TTFT."""
    sys.path.insert(0, str(HERE.parent))
    from reference_workload import prepared_engine, reference_config, serve_all

    from servelab.llm import EngineLoop

    config = reference_config()
    if threads is not None:
        config["engine"]["num_threads"] = threads
    if side == "offline":
        engine, requests = prepared_engine(config)
        if offline_mode == "serve_all":
            result = serve_all(engine, requests)
            wall, tokens = result.wall_s, result.outputs
            ttft = {r.request_id: r.ttft for r in engine.metrics.requests[-len(requests) :]}
        else:
            prompts = [r.prompt_token_ids for r in requests]
            start = time.perf_counter()
            outs = EngineLoop(engine).generate(prompts, [r.params for r in requests])
            wall = time.perf_counter() - start
            names = {o.request_id: r.request_id for o, r in zip(outs, requests)}
            tokens = {r.request_id: o.token_ids for o, r in zip(outs, requests)}
            ttft = {names[m.request_id]: m.ttft for m in engine.metrics.requests if m.request_id in names}  # fmt: skip
    elif server_cpu is None:
        wall, tokens, ttft = serve_and_stream(config)
    else:
        wall, tokens, ttft = stream_to_server_process(config, threads, server_cpu)
    import torch

    return {"side": side, "wall_s": wall, "output_tokens": sum(len(t) for t in tokens.values()),
            "tokens": tokens, "ttft_s": ttft, "pid": os.getpid(),
            "cpus": sorted(os.sched_getaffinity(0)), "torch_threads": torch.get_num_threads()}  # fmt: skip


def bench_server(config: dict, port: int):
    """The server of `config` on `port`, quiet, with room for every request at once."""
    from servelab.serve.server import Server

    serve = {"port": port, "log_level": "warning", "max_queued_requests": 100_000}
    return Server({**config, "serve": serve})


def serve_and_stream(config: dict) -> tuple[float, dict, dict]:
    """The server on a free port of 127.0.0.1 (uvicorn on a thread), one streaming
    client per request, all at once: wall time, tokens and client TTFT per request."""
    import asyncio
    import socket
    import threading

    from reference_workload import reference_requests

    from servelab.lab.runner import warm_up

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = bench_server(config, port)
    engine = server.engine
    requests = reference_requests(engine.model_config.vocab_size, engine.max_model_len)
    warm_up(engine)
    server.aengine.start()
    uv = server.make_uvicorn()
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    while not uv.started:
        if not thread.is_alive():
            raise SystemExit("the server did not start")
        time.sleep(0.02)
    url = f"http://127.0.0.1:{port}/v1/completions"

    try:
        results, wall = asyncio.run(drive_clients(url, requests))
    finally:
        uv.should_exit = True
        thread.join(30)
        server.aengine.stop()
    tokens = {r.request_id: t for r, (t, _) in zip(requests, results)}
    ttft = {r.request_id: first for r, (_, first) in zip(requests, results)}
    return wall, tokens, ttft


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_only(config: dict, port: int) -> None:
    """The server alone (a process of its own): warmed up, serving until SIGTERM."""
    from servelab.lab.runner import warm_up

    server = bench_server(config, port)
    warm_up(server.engine)
    raise SystemExit(server.run())


def stream_to_server_process(config: dict, threads, server_cpu: set[int]) -> tuple:
    """`serve_only` in a process pinned to `server_cpu`; this process (pinned
    elsewhere) is the 64 clients. Returns what `serve_and_stream` returns."""
    import asyncio
    import signal

    import httpx
    from reference_workload import reference_requests

    from servelab.model.config import named_config

    port = _free_port()
    command = [sys.executable, str(HERE), "--side", "serve-only", "--port", str(port)]
    if threads is not None:
        command += ["--threads", str(threads)]
    proc = subprocess.Popen(command, preexec_fn=lambda: os.sched_setaffinity(0, server_cpu))
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:  # up once /health answers
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the server process did not start")
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        model = named_config(config["model"]["name"])  # the reference preset names a shape
        requests = reference_requests(model.vocab_size, config["engine"]["max_model_len"])
        results, wall = asyncio.run(drive_clients(base + "/v1/completions", requests))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    tokens = {r.request_id: t for r, (t, _) in zip(requests, results)}
    ttft = {r.request_id: first for r, (_, first) in zip(requests, results)}
    return wall, tokens, ttft


def child(args: argparse.Namespace) -> None:
    if args.side == "serve-only":
        sys.path.insert(0, str(HERE.parent))
        from reference_workload import reference_config

        config = reference_config()
        if args.threads is not None:
            config["engine"]["num_threads"] = args.threads
        return serve_only(config, args.port)
    server_cpu = {int(c) for c in args.cpu.split(",")} if args.client_cpu else None
    result = run_side(args.side, args.threads, args.offline, server_cpu)
    print("RESULT " + json.dumps(result))


def spawn(side: str, args: argparse.Namespace) -> dict:
    command = [sys.executable, str(HERE), "--side", side, "--offline", args.offline]
    if args.threads is not None:
        command += ["--threads", str(args.threads)]
    if args.cpu:
        command += ["--cpu", args.cpu]
    if args.client_cpu:
        command += ["--client-cpu", args.client_cpu]
    pin = {int(c) for c in args.cpu.split(",")} if args.cpu else None
    if side == "server" and args.client_cpu:  # this process is the clients; it pins the server
        pin = {int(c) for c in args.client_cpu.split(",")}
    done = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=args.timeout,
        preexec_fn=(lambda: os.sched_setaffinity(0, pin)) if pin else None,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"the {side} run failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


# -- the comparison


def summarise(runs: list[dict]) -> dict:
    """The figures over paired repeats (repeat i: the i-th run of each side)."""
    from servelab.lab.stats import interval_text, mean_estimate, ratio_estimate, rounded

    offline = [r for r in runs if r["side"] == "offline"]
    server = [r for r in runs if r["side"] == "server"]
    reference = offline[0]["tokens"]
    identical = all(r["tokens"] == reference for r in runs)
    tok_s = {side: [r["output_tokens"] / r["wall_s"] for r in group]
             for side, group in (("offline", offline), ("server", server))}  # fmt: skip
    ratio = ratio_estimate(tok_s["server"], tok_s["offline"], paired=True)
    added = [s["ttft_s"][rid] - o["ttft_s"][rid]
             for o, s in zip(offline, server) for rid in o["ttft_s"] if rid in s["ttft_s"]]  # fmt: skip
    summary = {
        "repeats": len(server),
        "order": [r["side"] for r in runs],
        "tokens_identical": identical,
        "offline_tok_s": tok_s["offline"],
        "server_tok_s": tok_s["server"],
        "ratio": {"mean": ratio.mean, "low": ratio.low, "high": ratio.high},
        "median_added_ttft_ms": statistics.median(added) * 1000 if added else None,
    }
    lines = [
        f"offline: {rounded(mean_estimate(tok_s['offline']))} output tok/s",
        f"server:  {rounded(mean_estimate(tok_s['server']))} output tok/s "
        f"({len(reference)} concurrent streams)",
        f"ratio server/offline: {ratio.mean:.3f} {interval_text(ratio)} (paired, 95%)",
        f"median added TTFT per request: {summary['median_added_ttft_ms']:.1f} ms"
        if added else "median added TTFT per request: -",
        f"tokens identical in every run: {identical}",
    ]  # fmt: skip
    summary["text"] = "\n".join(lines)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="pairs of runs (default 5)")
    parser.add_argument("--cpu", default=None, help="CPUs to pin every run to, e.g. 1 or 0,1")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: the reference preset's)")  # fmt: skip
    parser.add_argument("--offline", choices=("generate", "serve_all"), default="generate")
    parser.add_argument("--json", default=None, help="also write the runs and figures here")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    parser.add_argument("--client-cpu", default=None,
                        help="run the clients in their own process on these CPUs")  # fmt: skip
    parser.add_argument("--side", choices=(*SIDES, "serve-only"), help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        return child(args)
    runs = []
    for i, side in enumerate(order(args.repeats)):
        runs.append(spawn(side, args))
        run = runs[-1]
        print(f"run {i + 1}: {side:7s} {run['output_tokens'] / run['wall_s']:9.1f} output tok/s",
              flush=True)  # fmt: skip
    summary = summarise(runs)
    print(summary["text"])
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs, **summary}, indent=1))
    if not summary["tokens_identical"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
