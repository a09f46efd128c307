"""`servelab route --ray` from the command line: the serve config composed in the proxy as
`servelab serve` composes it (a bad override fails before Ray starts), and a tensor-parallel
replica (two ranks in one placement group) on a Ray instance the command starts itself."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest

from servelab import LLM, SamplingParams
from servelab.cluster.route_cli import wait_healthy
from tests.serve.harness import free_port

SERVELAB = os.path.join(os.path.dirname(sys.executable), "servelab")


def test_a_bad_override_fails_before_any_replica_starts():
    done = subprocess.run([SERVELAB, "route", "--ray", "2", "--", "scheduler=nope"],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2
    assert "scheduler" in done.stderr and "nope" in done.stderr
    assert "Started a local Ray instance" not in done.stderr + done.stdout


@pytest.mark.slow
def test_a_tensor_parallel_replica_on_ray_gives_one_engines_tokens(tmp_path):
    port = free_port()
    command = [SERVELAB, "route", "--ray", "1", "--port", str(port), "--replica-cpus", "1", "--",
               "engine.dtype=float64", "engine.tensor_parallel_size=2"]  # fmt: skip
    process = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy([url], [process], 240)
        prompt = [5, 17, 42, 99, 3, 250]
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0,
                "ignore_eos": True}  # fmt: skip
        reply = httpx.post(url + "/v1/completions", json=body, timeout=120).json()
        greedy = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0)
        one = LLM(dtype="float64").generate(prompt, greedy)
        assert reply["choices"][0]["token_ids"] == one[0].outputs[0].token_ids
    finally:
        process.terminate()
        process.wait(60)
