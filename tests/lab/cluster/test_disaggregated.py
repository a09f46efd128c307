"""A simulated prefill/decode cluster: every request finishes once with the tokens a colocated
cluster gives it; each token is counted once (prompt on a prefill instance, the first token
there, the rest on a decode instance); a transfer the decode instance cannot hold waits or
recomputes as configured; the link's price shows in the transfer time and the tokens after
the first, exactly as latency + bytes / bandwidth says; bad options are clear errors."""

from __future__ import annotations

import pytest

from servelab.errors import ConfigError
from servelab.lab.cluster import run_disaggregated as run_module
from servelab.lab.cluster.run import run_cluster

# the tiny model: 2 layers, 2 KV heads, head dim 16, float32 -> K and V of one token
TINY_KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # = 512


def workload(num=30, prompt=(8, 40), output=(2, 10), rate=40.0) -> dict:
    def uniform(low, high):
        return {"dist": "uniform", "mean": (low + high) / 2, "std": 0, "min": low, "max": high}

    return {"name": "synthetic", "num_requests": num, "prompt_len": uniform(*prompt),
            "output_len": uniform(*output), "seed": 1, "arrival": "poisson", "rate": rate}  # fmt: skip


ENGINE = {"max_model_len": 128, "kv_cache_memory": "1MiB", "max_num_seqs": 4}


def config(cluster: dict, load=None, engine=ENGINE, router="round_robin") -> dict:
    return {"model": "tiny", "executor": "simulated", "router": router, "engine": engine,
            "cluster": cluster, "workload": load or workload()}  # fmt: skip


def spy_engines(monkeypatch) -> list:
    """The cluster's engines (prefill first), kept once a run is collected."""
    seen: list = []
    collect = run_module.collect

    def keep(cluster, router, keep_steps):
        seen[:] = [(i < cluster.num_prefill, e) for i, e in enumerate(cluster.engines)]
        return collect(cluster, router, keep_steps)

    monkeypatch.setattr(run_module, "collect", keep)
    return seen


def test_every_request_finishes_once_with_the_colocated_tokens(monkeypatch):
    engines = spy_engines(monkeypatch)
    colocated = run_cluster(config({"replicas": 4}))
    split = run_cluster(config({"prefill": 2, "decode": 2}))
    ids = [r.request_id for r in split.requests]
    assert sorted(ids) == sorted(set(ids)) and len(ids) == 30
    assert all(r.finish_reason == "length" for r in split.requests)
    assert split.summary["output_digest"] == colocated.summary["output_digest"]
    # round_robin over the 2 prefill instances; every request crossed to a decode instance
    assert [replica for _, replica in split.decisions] == [n % 2 for n in range(30)]
    assert {c["prefill_replica"] for c in split.columns.values()} == {0, 1}
    assert {c["decode_replica"] for c in split.columns.values()} <= {0, 1}
    assert split.summary["replicas"] == 4 and split.summary["kv_transfers"] == 30
    # tokens are conserved: prompts are prefilled once, on prefill instances; each request's
    # first token is sampled there, the others on decode instances
    prompts = sum(r.prompt_tokens for r in split.requests)
    outputs = sum(r.output_tokens for r in split.requests)
    assert outputs == sum(r.output_tokens for r in colocated.requests)
    steps = {role: [s for is_prefill, e in engines if is_prefill == role for s in e.metrics.steps]
             for role in (True, False)}  # fmt: skip
    assert sum(s.prefill_tokens for s in steps[True]) == prompts
    assert sum(s.decode_tokens for s in steps[True]) == 0
    assert sum(s.prefill_tokens for s in steps[False]) == 0
    assert sum(s.decode_tokens for s in steps[False]) == outputs - 30
    assert split.summary["decode_prefill_tokens"] == 0


def test_ttft_is_the_prefill_instances_first_token():
    split = run_cluster(config({"prefill": 1, "decode": 1}))
    for record in split.requests:
        assert record.first_token_time == record.token_times[0]
        assert len(record.token_times) == record.output_tokens
        assert record.token_times == sorted(record.token_times)


# a decode instance of 2 KV blocks (16 tokens each: 2 x 8 KiB) holds one request of a
# 20-token prompt and 8 outputs at a time; 6 requests arrive at once
FULL_ENGINE = {"max_model_len": 32, "kv_cache_memory": "16KiB", "max_num_seqs": 8}
FULL_LOAD = workload(num=6, prompt=(20, 20), output=(8, 8), rate=1000.0)


@pytest.mark.parametrize("transfer", ["wait", "recompute"])
def test_a_transfer_the_decode_instance_cannot_hold(monkeypatch, transfer):
    engines = spy_engines(monkeypatch)
    colocated = run_cluster(config({"replicas": 1}, FULL_LOAD, FULL_ENGINE))
    split = run_cluster(config({"prefill": 1, "decode": 1, "transfer": transfer}, FULL_LOAD,
                               FULL_ENGINE))  # fmt: skip
    assert split.summary["output_digest"] == colocated.summary["output_digest"]
    assert len(split.requests) == 6 and all(r.completed for r in split.requests)
    waits = [c["transfer_wait_s"] for c in split.columns.values()]
    assert max(waits) > 0.0  # some transfer arrived while the instance was full
    decode = [e for is_prefill, e in engines if not is_prefill][0]
    stats = decode.scheduler.stats()
    if transfer == "wait":  # admitted as they are, each when blocks free up
        assert stats["prefilled_admitted"] == 6 and stats["prefilled_recomputed"] == 0
        assert split.summary["decode_prefill_tokens"] == 0
    else:  # the ones that did not fit on arrival ran prompt + first token again
        recomputed = stats["prefilled_recomputed"]
        assert recomputed >= 1 and stats["prefilled_admitted"] == 6 - recomputed
        assert split.summary["decode_prefill_tokens"] == recomputed * 21


@pytest.mark.parametrize("name,latency,bandwidth", [("nvlink", 2e-6, 450e9),
                         ("infiniband", 5e-6, 50e9), ("pcie", 10e-6, 50e9)])  # fmt: skip
def test_link_cost_is_latency_plus_kv_bytes_over_bandwidth(name, latency, bandwidth):
    one = workload(num=1, prompt=(40, 40), output=(4, 4))
    base = run_cluster(config({"prefill": 1, "decode": 1, "link": "nvlink"}, one))
    split = run_cluster(config({"prefill": 1, "decode": 1, "link": name}, one))
    kv_bytes = 40 * TINY_KV_BYTES_PER_TOKEN  # the prompt's K and V: 20,480 bytes
    expected = latency + kv_bytes / bandwidth
    [columns] = split.columns.values()
    assert columns["kv_transfer_bytes"] == 20480
    assert columns["transfer_s"] == pytest.approx(expected, rel=1e-12)
    assert split.summary["transfer_ms_p50"] == pytest.approx(1000 * expected, rel=1e-12)
    # the first token is the prefill instance's: the link does not touch it; every later
    # token comes exactly the transfer-time difference later
    [record], [reference] = split.requests, base.requests
    assert record.first_token_time == reference.first_token_time
    shift = expected - (2e-6 + kv_bytes / 450e9)
    for later, earlier in zip(record.token_times[1:], reference.token_times[1:]):
        assert later - earlier == pytest.approx(shift, abs=1e-12)
    assert columns["transfer_wait_s"] == 0.0  # an idle decode instance admits it at once


def test_multi_turn_follow_ups_run_on_a_split_cluster():
    chats = {"name": "multi_turn", "num_conversations": 3, "turns": 2, "system_prompt_len": 4,
             "message_len": 6, "output_len": 3, "rate": 50.0, "think_time": 0.01}  # fmt: skip
    colocated = run_cluster(config({"replicas": 2}, chats))
    split = run_cluster(config({"prefill": 1, "decode": 1}, chats))
    assert len(split.requests) == 6
    assert split.summary["output_digest"] == colocated.summary["output_digest"]


@pytest.mark.parametrize(
    "cluster,message",
    [
        ({"prefill": 1, "decode": 1, "link": "ethernet"}, "links: nvlink, infiniband, pcie"),
        ({"prefill": 1, "decode": 1, "transfer": "drop"}, "one of wait, recompute"),
        (
            {"prefill": 1, "decode": 1, "decode_router": "nearest"},
            "unknown router 'nearest'; registered: least_load, power_of_two",
        ),
        ({"prefill": 1}, "needs both cluster.prefill and cluster.decode"),
        ({"prefill": 1, "decode": 1, "decoder": 2}, "unknown cluster option 'decoder'; accepted:"),
    ],
)
def test_bad_split_options_are_clear_errors(cluster, message):
    with pytest.raises(ConfigError, match=message):
        run_cluster(config(cluster))


def test_a_real_executor_is_refused_with_the_fix():
    node = config({"prefill": 1, "decode": 1})
    with pytest.raises(ConfigError, match="executor=simulated"):
        run_cluster({**node, "executor": "model", "engine": {**ENGINE, "cpu_kernels": "off"}})
