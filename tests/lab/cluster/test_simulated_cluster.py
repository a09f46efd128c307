"""A simulated cluster: N engines on one virtual clock behind a router.

Every request finishes exactly once, on the replica the router chose, with the tokens a
single engine gives it; the replicas' clocks share one origin; a cluster of one replica is
the single engine, figure for figure; bad cluster options are clear errors."""

from __future__ import annotations

import pytest

from servelab.cluster.options import cluster_options
from servelab.errors import ConfigError
from servelab.lab.cluster.run import engine_config, run_cluster
from servelab.lab.runner import run_config

WORKLOAD = {"name": "synthetic", "num_requests": 30, "prompt_len": {"dist": "uniform", "mean": 24,
            "std": 0, "min": 8, "max": 40}, "output_len": {"dist": "uniform", "mean": 6, "std": 0,
            "min": 2, "max": 10}, "seed": 1, "arrival": "poisson", "rate": 40.0}  # fmt: skip
ENGINE = {"max_model_len": 128, "kv_cache_memory": "1MiB", "max_num_seqs": 4}


def config(router="round_robin", replicas=3, **extra) -> dict:
    return {"model": "tiny", "executor": "simulated", "router": router, "engine": ENGINE,
            "cluster": {"replicas": replicas}, "workload": WORKLOAD, **extra}  # fmt: skip


def test_every_request_finishes_once_where_it_was_routed():
    result = run_cluster(config())
    ids = [r.request_id for r in result.requests]
    assert sorted(ids) == sorted(set(ids)) and len(ids) == WORKLOAD["num_requests"]
    assert [replica for _, replica in result.decisions] == [n % 3 for n in range(30)]
    assert result.placement == dict(result.decisions)
    assert result.summary["replicas"] == 3 and result.summary["load_imbalance"] == 1.0


def test_tokens_equal_a_single_engine():
    single = run_config({**engine_config(config()), "workload": WORKLOAD,
                         "run": {"warmup": False, "progress": False}})  # fmt: skip
    cluster = run_cluster(config(router="least_load"))
    assert cluster.summary["output_digest"] == single.summary["output_digest"]
    assert set(cluster.placement) == {r.request_id for r in single.requests}


def test_one_replica_is_the_single_engine():
    single = run_config({**engine_config(config()), "workload": WORKLOAD,
                         "run": {"warmup": False, "progress": False}})  # fmt: skip
    one = run_cluster(config(replicas=1))
    for figure in ("ttft_p50_ms", "ttft_p99_ms", "steps", "prefill_tokens", "wall_time_s"):
        assert one.summary[figure] == pytest.approx(single.summary[figure]), figure


def test_replicas_run_in_parallel_on_one_clock():
    one = run_cluster(config(replicas=1))
    four = run_cluster(config(replicas=4))
    # four replicas serve the same arrivals with shorter queues: first tokens come sooner
    assert four.summary["ttft_p99_ms"] < one.summary["ttft_p99_ms"]
    last_arrival = max(r.arrival_time for r in four.requests)
    assert max(r.finished_time for r in four.requests) >= last_arrival


def test_real_executor_is_refused_with_the_fix():
    with pytest.raises(ConfigError, match="executor=simulated"):
        run_cluster({**config(), "executor": "model", "engine": {**ENGINE, "cpu_kernels": "off"}})


@pytest.mark.parametrize(
    "node,message",
    [
        ({"replica": 2}, "unknown cluster option 'replica'; accepted: replicas"),
        ({"replicas": 0}, "cluster.replicas must be >= 1"),
        ({"prefill": 2}, "needs both cluster.prefill and cluster.decode"),
        ({"prefill": 1, "decode": 1, "transfer": "drop"}, "wait, recompute"),
    ],
)
def test_bad_cluster_options_are_clear_errors(node, message):
    with pytest.raises(ConfigError, match=message):
        cluster_options(node)


def test_link_transfer_time_is_latency_plus_bytes_over_bandwidth():
    from servelab.cluster.links import link

    # 1000 tokens of Llama-3-8B's KV: 32 layers x 8 KV heads x 128 dims x 2 (K, V) x 2 bytes
    kv_bytes = 1000 * 32 * 8 * 128 * 2 * 2
    assert link("infiniband").transfer_seconds(kv_bytes) == pytest.approx(5e-6 + kv_bytes / 50e9)
    assert link("nvlink").transfer_seconds(kv_bytes) < link("pcie").transfer_seconds(kv_bytes)
