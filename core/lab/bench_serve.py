"""`servelab bench serve`: replays a servelab workload against a running server
over HTTP, as a client measures it, and writes the offline runner's files.

Each request is sent when its arrival time comes (at most `concurrency` in
flight; the rest wait, and that wait counts as queueing), streamed, and timed
on the client: first token, every streamed step, the end. The records are the
engine's `RequestRecord`s filled from those times, so `results.json` and
`requests.csv` read like any run's and `servelab-report` compares them. There
are no engine steps on the client's side: steps.csv is empty and the step
figures of the summary are missing; throughput is over the client's wall clock.
The server's part choices (from `/v1/models`) are the run's choices, so a
report lines a served run up beside the offline runs of the same parts.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Mapping

from servelab.engine.metrics import RequestRecord
from servelab.engine.summary import summarize
from servelab.errors import ConfigError
from servelab.lab.runner import output_digest
from servelab.lab.workload import WorkloadRequest


async def _one(client, url: str, req: WorkloadRequest, index: int, t0: float, gate) -> tuple:
    await asyncio.sleep(max(0.0, t0 + req.arrival_time - time.perf_counter()))
    p = req.params
    body = {"prompt": req.prompt_token_ids, "max_tokens": p.max_tokens, "temperature": p.temperature,
            "top_p": p.top_p, "top_k": p.top_k, "ignore_eos": p.ignore_eos, "seed": p.seed,
            "stream": True, "priority": req.priority}  # fmt: skip
    arrival = t0 + req.arrival_time
    async with gate:
        sent, times, tokens, reason = time.perf_counter(), [], [], "error"
        async with client.stream("POST", url + "/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                choice = (json.loads(line[6:]).get("choices") or [{}])[0]
                if choice.get("token_ids"):
                    now = time.perf_counter()
                    tokens += choice["token_ids"]
                    times += [now - t0] * len(choice["token_ids"])
                reason = choice.get("finish_reason") or reason
    record = RequestRecord(
        request_id=req.request_id or f"req-{index}",
        arrival_time=arrival - t0,
        prompt_tokens=len(req.prompt_token_ids),
        output_tokens=len(tokens),
        first_scheduled_time=sent - t0,
        first_token_time=times[0] if times else None,
        finished_time=time.perf_counter() - t0,
        finish_reason=reason,
        preemptions=0,
        token_times=times,
    )
    return record, tokens


async def replay(url: str, requests: list[WorkloadRequest], concurrency: int,
                 api_key: str | None = None) -> tuple[list[RequestRecord], dict, float]:  # fmt: skip
    """Every request against `url`; the records, output tokens by id, and the wall time."""
    if any(r.after is not None for r in requests):
        raise ConfigError(
            "servelab bench serve replays timed arrivals only: this workload has follow-up "
            "requests (closed_loop); run it offline with `servelab`"
        )
    import httpx

    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(timeout=None, headers=headers, limits=limits) as client:
        t0 = time.perf_counter()
        done = await asyncio.gather(
            *(_one(client, url, r, i, t0, gate) for i, r in enumerate(requests))
        )
        wall = time.perf_counter() - t0
    return [d[0] for d in done], {d[0].request_id: [d[1]] for d in done}, wall


# what a client measures; the other figures of a summary count engine steps, which a
# client does not see: they are missing (null, "–" in a report), not zero
CLIENT_FIGURES = ("requests", "requests_total", "finished_pct", "output_tokens", "prompt_tokens",
                  "wall_time_s", "request_throughput", "output_tok_s", "total_tok_s")  # fmt: skip
CLIENT_LATENCIES = ("ttft_", "tpot_", "itl_", "e2e_", "queue_")


def bench_summary(records: list[RequestRecord], tokens: Mapping, wall: float) -> dict:
    """The runner's summary over the client's records and wall clock."""
    summary = {
        k: v if k in CLIENT_FIGURES or k.startswith(CLIENT_LATENCIES) else math.nan
        for k, v in summarize(records, []).items()
    }
    done = [r for r in records if r.completed]
    out = sum(r.output_tokens for r in done)
    prompt = sum(r.prompt_tokens for r in done)
    summary.update(wall_time_s=wall, request_throughput=len(done) / wall,
                   output_tok_s=out / wall, total_tok_s=(out + prompt) / wall,
                   output_digest=output_digest(dict(tokens)))  # fmt: skip
    return summary
