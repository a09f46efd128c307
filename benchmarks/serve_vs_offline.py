"""Throughput through the server against the offline engine, side by side in one
run: the reference workload (64 requests at once) served by `serve_all` on a
fresh engine, then by `servelab serve`'s app in this process, driven by 64
concurrent streaming HTTP clients. Prints output tok/s of both, their ratio and
the median time to first token each request gained through the server, and
checks that every stream got the offline tokens.

    python benchmarks/serve_vs_offline.py   (SERVELAB_BENCH_SMOKE=1: a quick check it runs)
"""

from __future__ import annotations

import asyncio
import json
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reference_workload import prepared_engine, reference_config, serve_all  # noqa: E402

from servelab.lab.runner import warm_up  # noqa: E402
from servelab.serve.server import Server  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def stream(client: httpx.AsyncClient, url: str, req) -> tuple[list[int], float, float]:
    """One streamed request: its tokens, time to first token, end-to-end."""
    p = req.params
    body = {"prompt": req.prompt_token_ids, "max_tokens": p.max_tokens, "stream": True,
            "temperature": p.temperature, "ignore_eos": p.ignore_eos}  # fmt: skip
    start, first, tokens = time.perf_counter(), None, []
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            choices = json.loads(line[6:]).get("choices") or []
            if choices and choices[0].get("token_ids"):
                first = first or time.perf_counter()
                tokens += choices[0]["token_ids"]
    return tokens, first - start, time.perf_counter() - start


def main() -> None:
    config = reference_config()
    engine, requests = prepared_engine(config)
    offline = serve_all(engine, requests)
    offline_ttft = {r.request_id: r.ttft for r in engine.metrics.requests}

    port = free_port()
    server = Server({**config, "serve": {"port": port, "log_level": "warning",
                                         "max_queued_requests": len(requests)}})  # fmt: skip
    warm_up(server.engine)
    server.aengine.start()
    uv = server.make_uvicorn()
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    while not uv.started:
        time.sleep(0.02)
    url = f"http://127.0.0.1:{port}"

    async def drive():
        limits = httpx.Limits(max_connections=len(requests))
        async with httpx.AsyncClient(timeout=600, limits=limits) as client:
            start = time.perf_counter()
            results = await asyncio.gather(*(stream(client, url, r) for r in requests))
            return results, time.perf_counter() - start

    results, wall = asyncio.run(drive())
    uv.should_exit = True
    thread.join(30)
    server.aengine.stop()

    same = all(
        tokens == offline.outputs[r.request_id] for r, (tokens, _, _) in zip(requests, results)
    )
    served = sum(len(t) for t, _, _ in results)
    added = [ttft - offline_ttft[r.request_id] for r, (_, ttft, _) in zip(requests, results)]
    print(f"offline: {offline.output_tok_s:.1f} output tok/s ({offline.wall_s:.2f} s)")
    print(f"server:  {served / wall:.1f} output tok/s ({wall:.2f} s), 64 concurrent streams")
    print(f"ratio server/offline: {served / wall / offline.output_tok_s:.2f}")
    print(f"median added TTFT per request: {statistics.median(added) * 1000:.1f} ms")
    print(f"tokens equal the offline run: {same}")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
