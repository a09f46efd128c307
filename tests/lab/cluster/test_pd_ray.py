"""Prefill/decode disaggregation on a real two-node Ray cluster on this machine: the
prefill and the decode engine are Ray actors on different nodes, the K/V moved by Ray's
object store or by a torch.distributed group the actors form; every request's tokens equal
transformers' greedy tokens and one engine's (the oracle's workload, float64)."""

from __future__ import annotations

import json

import pytest

from servelab.lab.cluster.pd_ray import run_pair_ray
from servelab.lab.request_builder import WorkloadRequest
from servelab.testing.oracle import cached_case, drive, engine_options
from tests.cluster.ray_harness import ray_cluster

pytestmark = pytest.mark.slow
COMBO = {"scheduler": {"name": "continuous"}, "attention": {"name": "per_request"},
         "allocator": {"name": "paged", "block_size": 4}, "preemption": {"name": "recompute"}}  # fmt: skip


@pytest.fixture(scope="module")
def cluster():
    with ray_cluster(nodes=2, cpus_per_node=1) as c:
        yield c


@pytest.mark.parametrize("kv_transport", ["object_store", "torch"])
def test_ray_actors_give_the_colocated_tokens(cluster, kv_transport):
    case = cached_case("qwen3")
    config = {"model": str(case.folder), **COMBO, "engine": engine_options(COMBO)}
    requests = [WorkloadRequest(prompt, params, request_id=f"r{i}")
                for i, (prompt, params) in enumerate(zip(case.prompts, case.params))]  # fmt: skip
    handed = sum(1 for out in case.expected if len(out) > 1)
    result = run_pair_ray(config, requests, kv_transport=kv_transport, hold_until=handed,
                          timeout=600)  # fmt: skip
    tokens = [result.outputs[f"r{i}"]["token_ids"] for i in range(len(requests))]
    assert tokens == case.expected  # transformers' greedy tokens
    assert tokens == drive(case, COMBO).tokens  # one engine with the same parts
    prefill, decode = result.prefill, result.decode
    assert prefill["sent"] == decode["received"] == handed
    prompt_tokens = sum(len(p) for p, out in zip(case.prompts, case.expected) if len(out) > 1)
    shape = json.loads((case.folder / "config.json").read_text())
    per_token = 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * shape["head_dim"]
    assert prefill["kv_bytes"] == prompt_tokens * per_token * 8  # k and v, float64
    assert decode["max_waiting"] > 0, "the burst should wait on the decode side"
    assert prefill["kv_blocks_held_at_end"] == decode["kv_blocks_held_at_end"] == 0
    assert prefill["backend"] == {"torch": "gloo", "object_store": "ray-object-store"}[kv_transport]
