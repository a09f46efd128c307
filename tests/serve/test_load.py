"""The server under real concurrent clients: greedy tokens equal `LLM.generate`
for every scheduler x allocator x preemption (one backend, a KV budget tight
enough to preempt); 64 concurrent streams each get their offline tokens once and
leave no block behind; SIGTERM during load exits 0 with every block free."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest
import torch

from servelab import LLM, SamplingParams
from servelab.testing.oracle import combinations, combo_id
from tests.serve.harness import Running, free_port, server_config

TIGHT = dict(max_model_len=64, kv_cache_memory=40 * 1024, swap_space=24 * 1024, max_num_seqs=8,
             max_num_batched_tokens=64, num_threads=1)  # fmt: skip
COMBOS = combinations(("scheduler", "allocator", "preemption"))


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 24, (count,), generator=g).tolist()
    return [torch.randint(0, 384, (n,), generator=g).tolist() for n in lengths]


async def stream_all(url: str, batch: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Every prompt as its own concurrent stream; each stream's token ids."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", timeout=120, max_retries=0)

    async def one(prompt):
        tokens = []
        stream = await client.completions.create(model=None, prompt=prompt, max_tokens=max_tokens,
                                                 temperature=0, stream=True,
                                                 extra_body={"ignore_eos": True})  # fmt: skip
        async for chunk in stream:
            tokens += chunk.choices[0].token_ids if chunk.choices else []
        return tokens

    try:
        return await asyncio.wait_for(asyncio.gather(*(one(p) for p in batch)), 300)
    finally:
        await client.close()


def assert_free(server) -> None:
    alloc = server.engine.allocator
    deadline = time.monotonic() + 20
    while server.aengine.num_pending or alloc.usage()["blocks_free"] != alloc.num_blocks:
        assert time.monotonic() < deadline, "a KV block leaked"
        time.sleep(0.02)
    assert not server.engine.has_unfinished()


@pytest.mark.parametrize("combo", COMBOS, ids=combo_id)
def test_every_combination_serves_the_offline_tokens(model_folder, combo):
    model = {"path": str(model_folder)}
    parts = {**combo, "attention": "per_request"}
    engine = {"dtype": "float64", **TIGHT}
    batch = prompts(8, seed=1)
    want = LLM(model=model, **parts, **engine).generate(
        batch, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))  # fmt: skip
    with Running(server_config(model, engine=TIGHT, **parts)) as server:
        got = asyncio.run(stream_all(server.url, batch, 16))
        assert_free(server)
    assert got == [o.token_ids for o in want]


def test_64_concurrent_streams_equal_offline_each_once(model_folder):
    model = {"path": str(model_folder)}
    batch = prompts(64, seed=2)
    want = LLM(model=model, dtype="float64", max_model_len=256).generate(
        batch, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))  # fmt: skip
    with Running(server_config(model, {"max_queued_requests": 64})) as server:
        got = asyncio.run(stream_all(server.url, batch, 24))
        assert_free(server)
        records = server.engine.metrics.requests
    assert got == [o.token_ids for o in want]
    assert len(records) == 64 and len({r.request_id for r in records}) == 64


def test_sigterm_during_load_exits_cleanly(model_folder, tmp_path):
    port = free_port()
    servelab = os.path.join(os.path.dirname(sys.executable), "servelab")
    cmd = [servelab, "serve", f"model.path={model_folder}", "engine.dtype=float64",
           "engine.max_model_len=256", f"serve.port={port}", "serve.grace_period=1",
           "serve.log_level=warning", f"hydra.run.dir={tmp_path}"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)

        async def load():
            client = httpx.AsyncClient(timeout=60)
            body = {"prompt": [5, 6, 7], "max_tokens": 240, "stream": True, "ignore_eos": True}

            async def one():
                lines = []
                try:
                    async with client.stream("POST", url + "/v1/completions", json=body) as r:
                        async for line in r.aiter_lines():
                            if line.startswith("data:"):
                                lines.append(line)
                    return r.status_code, lines[-2:]
                except httpx.HTTPError:
                    return "closed", lines[-2:]

            tasks = [asyncio.ensure_future(one()) for _ in range(16)]
            await asyncio.sleep(1.0)
            proc.send_signal(signal.SIGTERM)
            results = await asyncio.wait_for(asyncio.gather(*tasks), 60)
            await client.aclose()
            return results

        results = asyncio.run(load())
        assert proc.wait(60) == 0, proc.stdout.read()
        log = proc.stdout.read()
        # every stream ended in protocol: [DONE], after an error event if it was cut short
        assert all(status == 200 and tail[-1] == "data: [DONE]" for status, tail in results), results
        cut = [tail for _, tail in results if '"error"' in tail[0]]
        assert all("shutting down" in tail[0] for tail in cut)
        assert "still held" not in log and "Traceback" not in log, log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
