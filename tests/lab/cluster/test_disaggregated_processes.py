"""Prefill/decode disaggregation across two real processes (torch.distributed, gloo on
the CPU, float64): the prompt K/V travels with send/recv, and every request's tokens equal
transformers' greedy tokens and one engine's. The decode process takes the transfers in
one burst with a KV budget smaller than their prompts, so some must wait (or recompute)
and the decode side preempts."""

from __future__ import annotations

import json

import pytest

from servelab.lab.cluster.pd_processes import run_pair
from servelab.lab.request_builder import WorkloadRequest
from servelab.testing.oracle import cached_case, combo_id, drive, engine_options

ATTENTION = {"name": "per_request"}
CASES = [
    # (parts, transfer): paged + recompute, and others, the decode side full on arrival
    ({"allocator": {"name": "paged", "block_size": 4}, "preemption": {"name": "recompute"}}, "wait"),
    ({"allocator": {"name": "radix", "page_size": 4}, "preemption": {"name": "swap"}}, "wait"),
    (
        {"allocator": {"name": "paged", "block_size": 4, "prefix_caching": True},
         "preemption": {"name": "hybrid", "break_even_tokens": 16}},
        "recompute",
    ),
    # with these two, every allocator of the oracle's variants and every preemption policy
    # crosses the two processes (tests/engine/test_disaggregation.py: every pair, in one);
    # with one-token pages the burst waits on the decode side but nothing is preempted there
    ({"allocator": {"name": "radix", "page_size": 1},
      "preemption": {"name": "hybrid", "break_even_tokens": 16}}, "wait"),
    ({"allocator": {"name": "contiguous"}, "preemption": {"name": "swap"}}, "recompute"),
]  # fmt: skip


@pytest.mark.parametrize("parts,transfer", CASES, ids=[f"{combo_id(p)}|{t}" for p, t in CASES])
def test_two_processes_give_the_colocated_tokens(parts, transfer):
    case = cached_case("qwen3")
    combo = {"scheduler": {"name": "continuous"}, **parts, "attention": ATTENTION}
    config = {"model": str(case.folder), **combo, "engine": engine_options(combo)}
    requests = [
        WorkloadRequest(prompt, params, request_id=f"r{i}")
        for i, (prompt, params) in enumerate(zip(case.prompts, case.params))
    ]
    handed = sum(1 for out in case.expected if len(out) > 1)  # the first token did not end it
    result = run_pair(config, requests, transfer=transfer, hold_until=handed, timeout=900)
    tokens = [result.outputs[f"r{i}"]["token_ids"] for i in range(len(requests))]
    assert tokens == case.expected  # transformers' greedy tokens
    assert tokens == drive(case, combo).tokens  # one engine with the same parts
    decode, prefill = result.decode, result.prefill
    assert prefill["backend"] == decode["backend"] == "gloo"
    assert prefill["sent"] == decode["received"] == handed
    # the K/V really travelled: every handed-over prompt's tokens, float64, every layer
    prompt_tokens = sum(len(p) for p, out in zip(case.prompts, case.expected) if len(out) > 1)
    shape = json.loads((case.folder / "config.json").read_text())
    per_token = 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * shape["head_dim"]
    assert prefill["kv_bytes"] == prompt_tokens * per_token * 8  # k and v, float64
    stats = decode["scheduler"]
    if transfer == "wait":
        assert decode["max_waiting"] > 0, "no transfer had to wait on the decode side"
        if parts["allocator"] != {"name": "radix", "page_size": 1}:
            assert decode["preempted"] > 0, "nothing was preempted on the decode side"
    else:
        assert stats["prefilled_recomputed"] > 0, "no transfer fell back to recomputing"
    assert prefill["kv_blocks_held_at_end"] == decode["kv_blocks_held_at_end"] == 0


def test_the_command_line_takes_real_executors_to_the_pair_and_refuses_more_instances(tmp_path):
    from servelab.errors import ConfigError
    from servelab.lab.cluster.pd_cli import is_real_pair, run_pair_job

    pair = {"prefill": 1, "decode": 1}
    assert is_real_pair({"cluster": pair})  # executor=model is the default
    assert is_real_pair({"cluster": pair, "executor": {"name": "model"}})
    assert not is_real_pair({"cluster": pair, "executor": "simulated"})
    assert not is_real_pair({"cluster": {"replicas": 2}})
    with pytest.raises(ConfigError, match="one prefill and one decode process"):
        run_pair_job({"cluster": {"prefill": 2, "decode": 1}}, {}, tmp_path)


class _IdleEngine:
    """The decode loop's view of an engine with nothing to do (the wire is under test)."""

    t0 = 0.0

    def has_unfinished(self) -> bool:
        return False


def test_a_failed_receive_ends_the_decode_loop_with_the_cause(monkeypatch):
    from servelab.errors import ServelabError
    from servelab.lab.cluster import pd_processes

    def broken_wire(*args, **kwargs):
        raise RuntimeError("Connection closed by peer")

    monkeypatch.setattr(pd_processes, "recv_prefilled", broken_wire)
    with pytest.raises(ServelabError, match="failed receiving transfer 1 .*Connection closed"):
        pd_processes.serve_decode(_IdleEngine(), None, "wait", timeout=600)


def test_a_silent_prefill_side_ends_the_decode_loop_at_its_timeout(monkeypatch):
    import threading

    from servelab.errors import ServelabError
    from servelab.lab.cluster import pd_processes

    never = threading.Event()
    monkeypatch.setattr(pd_processes, "recv_prefilled", lambda *a, **k: never.wait() and None)
    with pytest.raises(ServelabError, match="waited 0 s for transfer 1 .*holding for 2"):
        pd_processes.serve_decode(_IdleEngine(), None, "wait", hold_until=2, timeout=0.1)
    never.set()  # the receiving thread returns None: END
