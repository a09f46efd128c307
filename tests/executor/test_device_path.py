"""The device path on a CPU: decode CUDA graphs' bucket choice, graph safety and
eager fallback (`servelab.executor.cuda_graphs`), the padded decode a graph
replays (run eagerly through the same static buffers with the real graph-safe
backend, `triton_paged`, interpreted) against the plain eager step, KV sizing
with made-up device figures (`servelab.executor.device_memory`), staging round
trips (`servelab.step.staging`), the engine options `cuda_graphs` and
`gpu_memory_utilization`, every engine run against transformers' greedy tokens,
and a smoke run of `benchmarks/gpu_throughput.py --tiny`. The CUDA-only half is
`test_cuda_only.py`.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import yaml

import servelab.executor.device_memory
import servelab.executor.model_runner
from servelab import LLM
from servelab.engine.build import ENGINE_DEFAULTS, attention_backend, engine_options
from servelab.errors import ConfigError
from servelab.executor.cuda_graphs import (
    PAD_SLOT,
    DecodeGraphRunner,
    backend_is_graph_safe,
    graph_buckets,
    pick_bucket,
)
from servelab.executor.device_memory import (
    DeviceMemory,
    GiB,
    MemoryBudget,
    device_memory_budget,
    estimate_activation_bytes,
    kv_cache_budget,
    model_weight_bytes,
)
from servelab.model.config import NAMED_SHAPES, named_config
from servelab.model.transformer import Transformer
from servelab.step.metadata import AttentionMetadata
from servelab.step.staging import StepStaging
from servelab.testing.oracle import cached_case, restored_num_threads
from servelab.testing.oracle import engine_options as oracle_engine_options
from tests.benchmark_scripts import load_benchmark
from tests.executor.decode_scenes import (
    TRITON_DEVICE,
    CpuReplayRunner,
    assert_same_decode,
    make_scene,
    scene_runner,
    skip_unless_triton_interpreted,
)

ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------- buckets


@pytest.mark.parametrize("max_num_seqs", [1, 2, 3, 7, 8, 9, 16, 17, 31, 32, 100, 256, 257])
def test_buckets_hold_every_batch_with_little_padding(max_num_seqs):
    buckets = graph_buckets(max_num_seqs)
    assert list(buckets) == sorted(set(buckets)) and buckets[-1] == max_num_seqs
    for n in range(1, max_num_seqs + 1):
        expected = min(b for b in buckets if b >= n)  # brute force
        assert pick_bucket(buckets, n) == expected
        assert expected - n < 16  # at most one bucket step of padding rows
    assert pick_bucket(buckets, max_num_seqs + 1) is None


def test_graph_buckets_rejects_an_empty_engine():
    with pytest.raises(ValueError):
        graph_buckets(0)


def test_graph_safety_comes_from_the_backend():
    config = named_config("tiny")
    assert backend_is_graph_safe(attention_backend("triton_paged", config))
    for name in ("padded", "per_request", "flash_varlen"):
        assert not backend_is_graph_safe(attention_backend(name, config)), name
    # a declared flag wins over the name
    assert backend_is_graph_safe(SimpleNamespace(name="mine", graph_safe=True))
    assert not backend_is_graph_safe(SimpleNamespace(name="triton_paged", graph_safe=False))


@pytest.mark.gpu_path
def test_padded_decode_matches_eager_and_writes_only_real_slots():
    """What a replay computes (static buffers, padded to 8 then 4 rows, graph-safe
    backend), run eagerly: the second step's padding rows were real rows of the first."""
    scene = make_scene(TRITON_DEVICE, torch.float64, "triton_paged")
    runner = scene_runner(scene, TRITON_DEVICE)
    assert [pick_bucket(runner.buckets, m.num_seqs) for _, m in scene.steps] == [8, 4]
    assert_same_decode(scene, runner.run_padded_eager, tol=1e-12)
    assert torch.all(runner.static.slot_mapping[3:4] == PAD_SLOT)


@pytest.mark.gpu_path
def test_one_big_bucket_pads_a_single_sequence():
    scene = make_scene(TRITON_DEVICE, torch.float64, "triton_paged", prompt_lens=(5, 2), second=1)
    runner = scene_runner(scene, TRITON_DEVICE, buckets=[8])
    assert_same_decode(scene, runner.run_padded_eager, tol=1e-12)


@pytest.mark.parametrize("enabled", [True, False])
def test_runner_on_cpu_runs_eagerly(enabled):
    scene = make_scene("cpu", torch.float32, "per_request")
    runner = scene_runner(scene, "cpu", enabled=enabled)
    assert not runner.enabled
    assert ("CUDA device" if enabled else "off") in runner.disabled_reason
    runner.capture()  # nothing to capture
    assert not runner.graphs
    assert_same_decode(scene, runner.run, tol=0)
    assert runner.num_eager == 2 and runner.num_replays == 0


def test_padded_eager_refuses_prefill_and_oversized_batches():
    scene = make_scene("cpu", torch.float32, "per_request", prompt_lens=(2, 3, 4), second=1)
    runner = DecodeGraphRunner(
        scene.forward, scene.backend, max_num_seqs=2, max_model_len=32, block_size=4, device="cpu"
    )
    ids, meta = scene.steps[0]  # three sequences, largest bucket 2
    with pytest.raises(ValueError, match="exceeds"):
        runner.run_padded_eager(ids, meta)
    prefill = AttentionMetadata.from_lists([2], [2], [[0]], 4)
    with pytest.raises(ValueError, match="decode"):
        runner.run_padded_eager(torch.tensor([1, 2]), prefill)


# ---------------------------------------------------------------- KV sizing


def test_kv_budget_is_utilization_minus_weights_and_activations():
    total, weights, act = 80 * GiB, int(1.2 * GiB), 3 * GiB
    expected = int(total * 0.9) - weights - act
    assert kv_cache_budget(total, 0.9, weights, act) == expected
    # plenty free: no cap; little free: the activations must still fit next to the cache
    assert kv_cache_budget(total, 0.9, weights, act, free_bytes=total - weights) == expected
    assert kv_cache_budget(total, 0.9, weights, act, free_bytes=10 * GiB) == 10 * GiB - act


def test_kv_budget_error_names_the_numbers():
    with pytest.raises(ConfigError) as err:
        kv_cache_budget(16 * GiB, 0.25, 3 * GiB, 2 * GiB)
    message = str(err.value)
    for figure in ("0.25", "16.00 GiB", "4.00 GiB", "3.00 GiB", "2.00 GiB"):
        assert figure in message, (figure, message)
    with pytest.raises(ConfigError, match="another process"):
        kv_cache_budget(16 * GiB, 0.9, GiB, 2 * GiB, free_bytes=GiB)


@pytest.mark.parametrize("utilization", [0, -0.1, 1.5, True, "0.9"])
def test_utilization_must_be_a_fraction(utilization):
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        kv_cache_budget(GiB, utilization, 0, 0)


def test_utilization_needs_cuda():
    with pytest.raises(ConfigError, match="kv_cache_memory"):
        device_memory_budget("cpu", 0.9, 0)


@pytest.mark.parametrize("name", sorted(NAMED_SHAPES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_weight_bytes_match_the_model(name, dtype):
    model = Transformer(named_config(name), dtype, "meta")  # shapes only, no memory
    actual = sum(p.numel() * p.element_size() for p in model.parameters())
    assert model_weight_bytes(named_config(name), dtype) == actual


def test_activation_estimate_covers_the_largest_tensors():
    config = named_config("qwen3-0.6b")
    tokens, seqs = 8192, 256
    estimate = estimate_activation_bytes(config, tokens, seqs, "bfloat16")
    mlp_pair = 2 * tokens * config.intermediate_size * 2  # gate and up outputs, bf16
    logits = seqs * config.vocab_size * 4  # float32 logits
    assert estimate >= mlp_pair + logits
    assert estimate < estimate_activation_bytes(config, 2 * tokens, seqs, "bfloat16")
    assert estimate < estimate_activation_bytes(config, tokens, 2 * seqs, "bfloat16")


def test_memory_budget_keeps_its_figures():
    budget = MemoryBudget(10 * GiB, 0.5, GiB, GiB)
    assert budget.allowed_bytes == 5 * GiB and budget.kv_bytes == 3 * GiB


# ---------------------------------------------------------------- step staging


def test_staging_round_trip_with_one_upload():
    staging = StepStaging("cpu", capacity_bytes=64)  # small: forces growth
    staging.begin()
    staging.put("positions", [5, 6, 7], torch.int64)
    staging.put("seq_lens", np.array([6, 7, 8], dtype=np.int64), torch.int32)
    view = staging.host_view("slots", 3, torch.int64)
    view.numpy()[:] = np.arange(3) * 10  # filled in place, after growth moved the buffer
    staging.put("table", torch.tensor([[1, 2], [3, 4]]), torch.int32)
    out = staging.upload()
    assert out["positions"].tolist() == [5, 6, 7] and out["positions"].dtype == torch.int64
    assert out["seq_lens"].tolist() == [6, 7, 8] and out["seq_lens"].dtype == torch.int32
    assert out["slots"].tolist() == [0, 10, 20]
    assert out["table"].tolist() == [1, 2, 3, 4]
    base = staging.device_buffer.data_ptr()
    assert all((t.data_ptr() - base) % StepStaging.ALIGN == 0 for t in out.values())
    assert staging.capacity_bytes >= staging.used_bytes > 64
    assert not staging.host.is_pinned()  # nothing to copy to: no pinning
    staging.begin()
    assert staging.used_bytes == 0
    staging.put("positions", [9], torch.int64)
    assert staging.upload()["positions"].tolist() == [9]


def test_staged_metadata_equals_the_plain_build():
    """`from_lists` through a staging buffer (what prepare does on CUDA) builds
    the same tensors as the plain build, as views of the one uploaded buffer,
    next to a field the caller put first."""
    lists = dict(
        query_lens=[1, 1, 3, 5, 2],
        seq_lens=[7, 2, 3, 9, 6],
        block_tables=[[5, 1], [0], [2], [3, 4, 6], [7, 8]],
        block_size=4,
        sample_mask=[True, True, False, True, True],
    )
    plain = AttentionMetadata.from_lists(**lists)
    staging = StepStaging("cpu", capacity_bytes=16)  # small: grows mid-step
    staging.begin()
    staging.put("input_ids", [9, 8, 7], torch.int64)
    staged = AttentionMetadata.from_lists(**lists, staging=staging)
    for field in dataclasses.fields(AttentionMetadata):
        want, have = getattr(plain, field.name), getattr(staged, field.name)
        if isinstance(want, torch.Tensor):
            assert have.dtype == want.dtype and torch.equal(have, want), field.name
            buffer = staging.device_buffer
            start = buffer.data_ptr()
            assert start <= have.data_ptr() < start + buffer.numel(), field.name
        else:
            assert have == want, field.name
    assert staging.views["input_ids"].tolist() == [9, 8, 7]


def test_engine_steps_through_a_staging_buffer():
    """prepare's CUDA path (ids and metadata staged, one upload per step),
    driven on the CPU: the tokens stay transformers' greedy tokens."""
    case, llm = oracle_llm()
    staging = llm.engine.executor.runner.staging = StepStaging("cpu", capacity_bytes=64)
    assert oracle_tokens(llm, case) == case.expected
    assert staging.capacity_bytes > 64  # steps really went through it


# ---------------------------------------------------------------- engine options


def test_engine_option_defaults_match_the_yaml():
    yaml_engine = yaml.safe_load((ROOT / "conf" / "config.yaml").read_text())["engine"]
    for name, default in (("cuda_graphs", False), ("gpu_memory_utilization", None)):
        assert ENGINE_DEFAULTS[name] is default and yaml_engine[name] is default, name


@pytest.mark.parametrize("value", ["yes", "true", 1, None])
def test_cuda_graphs_must_be_a_bool(value):
    with pytest.raises(ConfigError, match="cuda_graphs must be true or false"):
        engine_options({"cuda_graphs": value})


@pytest.mark.parametrize("value", [0, -0.5, 1.01, True, "0.9"])
def test_gpu_memory_utilization_must_be_a_fraction(value):
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        engine_options({"gpu_memory_utilization": value})


def test_accepted_device_options():
    for node in (
        {"cuda_graphs": True},
        {"gpu_memory_utilization": 1},
        {"gpu_memory_utilization": 0.5},
    ):
        assert engine_options(node).items() >= node.items()


def test_gpu_memory_utilization_on_cpu_fails_before_loading(monkeypatch):
    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the option was refused")

    monkeypatch.setattr("servelab.plugins.executors.model.load_model", no_load)
    with pytest.raises(ConfigError) as err:
        LLM(model="tiny", device="cpu", gpu_memory_utilization=0.9)
    message = str(err.value)
    for part in ("gpu_memory_utilization", "kv_cache_memory", "device=cpu"):
        assert part in message, (part, message)


MiB = 1024**2


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("free_limits", [False, True])
def test_kv_cache_is_sized_from_the_device_budget(monkeypatch, graphs, free_limits):
    """A made-up device: 80 GiB, 3 GiB held before the weights load (not
    weights), loading adds exactly the model's weights. The engine's KV cache
    must hold what total x utilization - weights - activation estimate leaves
    (with graphs, their decode bucket's estimate too), or, when another process
    holds memory, what is free less the activations."""
    config, dtype = named_config("tiny"), torch.float32
    max_num_seqs, batched, block_size = 8, 256, 4
    weights = model_weight_bytes(config, dtype)
    activations = estimate_activation_bytes(config, batched, max_num_seqs, dtype)
    if graphs:
        activations += estimate_activation_bytes(config, max_num_seqs, max_num_seqs, dtype)
    total, held_before = 80 * GiB, 3 * GiB
    utilization = (3 * MiB + weights + activations) / total  # about 3 MiB of KV
    free_before = weights + activations + MiB if free_limits else total - held_before
    expected_kv = int(total * utilization) - weights - activations
    if free_limits:
        expected_kv = min(expected_kv, free_before - weights - activations)
    readings = [
        DeviceMemory(total, free_before, held_before),  # before the weights load
        DeviceMemory(total, free_before - weights, held_before + weights),  # after
    ]
    devices = []

    def fake_read_device_memory(device):
        devices.append(torch.device(device).type)
        return readings[min(len(devices), 2) - 1]

    monkeypatch.setattr(
        servelab.executor.device_memory, "read_device_memory", fake_read_device_memory
    )
    llm = LLM(
        model="tiny",
        allocator={"name": "paged", "block_size": block_size},
        device="cpu",
        dtype="float32",
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=batched,
        max_model_len=128,
        gpu_memory_utilization=utilization,
        cuda_graphs=graphs,
    )
    assert devices == ["cpu", "cpu"]  # read once before and once after the weights
    kv_per_token = config.kv_bytes_per_token(dtype)
    expected_blocks = expected_kv // kv_per_token // block_size
    assert expected_kv < 4 * MiB  # not the 64 MiB kv_cache_memory default
    assert llm.engine.allocator.num_blocks == expected_blocks
    assert (
        llm.engine.executor.kv_cache.device_pool.nbytes
        == expected_blocks * block_size * kv_per_token
    )


# ---------------------------------------------------------------- the engine's decode path

# the oracle's checkpoint (float64, transformers' greedy tokens recorded) with a
# paged cache small enough that on-demand admission preempts
ORACLE_PARTS = dict(
    scheduler={"name": "continuous", "admission": "on_demand"},
    allocator={"name": "paged", "block_size": 4},
)


def oracle_llm(attention="per_request", **engine):
    case = cached_case("qwen3")
    parts = dict(ORACLE_PARTS, attention=attention)
    return case, LLM(model=str(case.folder), **parts, **oracle_engine_options(parts, **engine))


def oracle_tokens(llm, case, count=None):
    """Greedy tokens of the first `count` oracle prompts, on one thread."""
    with restored_num_threads(1):
        outputs = llm.generate(case.prompts[:count], case.params[:count])
    return [out.outputs[0].token_ids for out in outputs]


def forward_steps(llm) -> tuple[int, int]:
    """(steps that ran a forward, those with one query token per sequence), from
    the engine's step records."""
    ran = [s for s in llm.engine.metrics.steps if s.num_seqs > 0]
    single = [s for s in ran if s.prefill_tokens + s.decode_tokens == s.num_seqs]
    return len(ran), len(single)


def test_cuda_graphs_off_leaves_the_cpu_path_as_it_was():
    case, llm = oracle_llm()
    runner = llm.engine.executor.runner
    assert runner.graphs is None and runner.staging is None
    assert runner.graphs_status.startswith("off")
    assert oracle_tokens(llm, case) == case.expected


def test_cuda_graphs_on_a_cpu_fall_back_to_eager_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="servelab.executor.model_runner"):
        case, llm = oracle_llm(cuda_graphs=True)
    graphs = llm.engine.executor.runner.graphs
    status = llm.engine.executor.runner.graphs_status
    assert status.startswith("eager:") and "CUDA device" in status
    assert any("decode runs eagerly" in r.getMessage() for r in caplog.records)
    assert not graphs.graphs
    assert oracle_tokens(llm, case) == case.expected
    ran, _ = forward_steps(llm)
    assert graphs.num_eager == ran and graphs.num_replays == 0  # every step went through it


def test_decode_steps_replay_through_the_model_runner(monkeypatch):
    """The engine with graphs captured (graph-safe `triton_paged`, interpreted;
    graphs stood in for by `ForwardReplay`): every one-token-per-sequence step
    replays a bucket without planning, every other step plans and runs eagerly,
    and the tokens are still transformers' greedy tokens."""
    skip_unless_triton_interpreted()  # the CUDA twin: test_engine_replays_decode_graphs_on_cuda
    monkeypatch.setattr(servelab.executor.model_runner, "DecodeGraphRunner", CpuReplayRunner)
    case, llm = oracle_llm("triton_paged", cuda_graphs=True)
    runner = llm.engine.executor.runner
    assert runner.graphs_status.startswith("captured"), runner.graphs_status
    assert sorted(runner.graphs.graphs) == list(graph_buckets(8))
    backend, plans = llm.engine.backend, []
    plan = backend.plan
    monkeypatch.setattr(backend, "plan", lambda meta: plans.append(meta) or plan(meta))
    count = 6
    assert oracle_tokens(llm, case, count) == case.expected[:count]
    ran, single = forward_steps(llm)
    assert single > 0 and ran > single
    assert runner.graphs.num_replays == single and runner.graphs.num_eager == ran - single
    assert len(plans) == ran - single  # a replayed step is not planned again


def test_a_graph_unsafe_backend_stays_eager_where_graphs_could_run(monkeypatch, caplog):
    monkeypatch.setattr(servelab.executor.model_runner, "DecodeGraphRunner", CpuReplayRunner)
    with caplog.at_level(logging.WARNING, logger="servelab.executor.model_runner"):
        case, llm = oracle_llm("per_request", cuda_graphs=True)
    runner = llm.engine.executor.runner
    assert runner.graphs_status.startswith("eager:") and "per_request" in runner.graphs_status
    assert any("not graph-safe" in r.getMessage() for r in caplog.records)
    count = 4
    assert oracle_tokens(llm, case, count) == case.expected[:count]
    assert runner.graphs.num_replays == 0 and runner.graphs.num_eager == forward_steps(llm)[0]


# ---------------------------------------------------------------- the benchmark, tiny


def test_throughput_benchmark_tiny_smoke(tmp_path):
    bench = load_benchmark("gpu_throughput")
    results = bench.main(
        [
            "--tiny",
            "--backends",
            "padded",
            "--graphs",
            "off",
            "--requests",
            "4",
            "--out",
            str(tmp_path),
        ]
    )
    workload = bench.make_workload(4, 4, 32, named_config("tiny").vocab_size, seed=0)
    (result,) = results
    assert result.status == "ok" and result.requests_done == 4
    assert result.output_tokens == workload.num_output_tokens  # ignore_eos: every token
    assert result.output_tok_s > 0 and 0 < result.roofline_fraction < 1
    assert (tmp_path / "gpu_throughput.md").is_file() and (
        tmp_path / "gpu_throughput.json"
    ).is_file()


def test_throughput_benchmark_compiled_row(tmp_path):
    """`--compile`: the engine runs the compiled forward, the row says so, and the
    timed run compiles nothing (every shape compiled in the warm-up)."""
    bench = load_benchmark("gpu_throughput")
    args = ["--tiny", "--backends", "padded", "--graphs", "off", "--compile", "--requests", "3"]
    (result,) = bench.main([*args, "--out", str(tmp_path)])
    assert result.status == "ok" and result.graphs == "off+compile"
    assert (
        result.output_tokens
        == bench.make_workload(3, 4, 32, named_config("tiny").vocab_size, seed=0).num_output_tokens
    )
    assert "0 dynamo graphs compiled while timed" in result.notes


def tiny_args(bench, tmp_path):
    return bench.parse_args(
        ["--tiny", "--backends", "padded", "--requests", "2", "--out", str(tmp_path)]
    )


def test_throughput_run_frees_its_engine_before_the_next(tmp_path, monkeypatch):
    """The engine (its KV cache) is gone when the benchmark returns memory to the
    device: the next run then sizes its cache at equal memory."""
    import weakref

    bench = load_benchmark("gpu_throughput")
    args = tiny_args(bench, tmp_path)
    workload = bench.make_workload(2, 4, 32, named_config("tiny").vocab_size, seed=0)
    built, alive_at_free = [], []
    build = bench.build_llm
    monkeypatch.setattr(
        bench,
        "build_llm",
        lambda *a: built.append(weakref.ref((llm := build(*a)).engine.executor.kv_cache)) or llm,
    )
    free = bench.free_device_memory
    monkeypatch.setattr(
        bench,
        "free_device_memory",
        lambda device: (free(device), alive_at_free.append(built[-1]() is not None)),
    )
    result = bench.run_one(args, "padded", False, workload, bandwidth=1e9)
    assert result.status == "ok" and alive_at_free == [False]


def test_a_failure_while_building_is_a_row(tmp_path, monkeypatch):
    bench = load_benchmark("gpu_throughput")
    args = tiny_args(bench, tmp_path)

    def fail(*_):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    monkeypatch.setattr(bench, "build_llm", fail)
    result = bench.run_one(args, "padded", True, bench.make_workload(2, 4, 8, 64, 0), 1e9)
    assert result.status.startswith("error building: RuntimeError") and result.wall_s == 0
