"""The simulated executor: no weights or KV tensors, the KV budget from the
profile and the shape, stand-in tokens, a virtual clock the runner does not
sleep on, and the hardware profiles."""

from __future__ import annotations

import json
import time

import pytest

from servelab import LLM, SamplingParams
from servelab.engine.build import build_engine
from servelab.errors import ConfigError
from servelab.executor.device_memory import estimate_activation_bytes
from servelab.executor.hardware import load_profile, profile_names
from servelab.lab.runner import run_config, save_run, serve
from servelab.lab.workload import make_workload
from servelab.llm import EngineLoop
from servelab.model.config import named_config

GiB = 1024**3


def simulated(**options):
    return LLM(model="tiny", executor="simulated", **options).engine


def test_nothing_is_allocated():
    executor = simulated().executor
    assert executor.device is None and executor.kv_layout(4) is None
    assert executor.read_kv([0], 4) is None
    assert not any(hasattr(executor, name) for name in ("model", "kv_cache", "runner"))


def llama8b_params() -> int:
    """Llama-3-8B's parameter count from its shape, written out."""
    h, inter, layers, vocab = 4096, 14336, 32, 128256
    attn = h * 32 * 128 + 2 * h * 8 * 128 + 32 * 128 * h  # q, k, v, o
    mlp = 3 * h * inter
    return 2 * vocab * h + layers * (attn + mlp + 2 * h) + h  # untied head, norms


@pytest.mark.parametrize("tp", [1, 2])
def test_kv_budget_is_memory_times_utilisation_less_weights_and_activations(tp):
    options = dict(
        dtype="bfloat16",
        gpu_memory_utilization=0.9,
        max_model_len=4096,
        max_num_seqs=64,
        max_num_batched_tokens=4096,
        tensor_parallel_size=tp,
    )
    engine = LLM(model="llama3-8b", executor="simulated", hardware="h100-sxm", **options).engine
    activations = estimate_activation_bytes(named_config("llama3-8b"), 4096, 64, "bfloat16")
    per_gpu = int(80 * GiB * 0.9) - 2 * llama8b_params() // tp - activations
    per_token = 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 heads of 128, bf16
    assert engine.allocator.usage()["tokens_capacity"] == pytest.approx(
        tp * per_gpu // per_token, abs=16
    )  # whole blocks of 16


def test_kv_budget_from_kv_cache_memory():
    engine = simulated(kv_cache_memory="1MiB", dtype="float32")
    assert engine.allocator.usage()["tokens_capacity"] == 1024**2 // (2 * 2 * 2 * 16 * 4)


def test_stand_in_tokens_are_deterministic_differ_between_forks_and_run_to_max_tokens():
    params = SamplingParams(temperature=0.0, max_tokens=12, n=2)
    first = LLM(model="tiny", executor="simulated").generate([[5, 6, 7], [5, 6, 7]], params)
    again = LLM(model="tiny", executor="simulated").generate([[5, 6, 7], [5, 6, 7]], params)
    samples = [[c.token_ids for c in out.outputs] for out in first]
    assert samples == [[c.token_ids for c in out.outputs] for out in again]
    for forks in samples:
        assert forks[0] != forks[1] and all(len(s) == 12 for s in forks)
    assert samples[0] != samples[1]  # two requests, two texts
    eos = set(named_config("tiny").eos_token_ids)
    assert not eos & {t for forks in samples for s in forks for t in s}


def test_the_clock_is_virtual_and_steps_take_their_modelled_time():
    engine = simulated()
    assert engine.now() == 0.0
    EngineLoop(engine).generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4))
    steps = engine.metrics.steps
    assert all(s.wall_time > 0 for s in steps)
    assert engine.now() == pytest.approx(sum(s.wall_time for s in steps))


def test_the_runner_does_not_sleep_on_a_virtual_clock(monkeypatch):
    slept = []  # every real sleep, counted instead of timed
    monkeypatch.setattr(time, "sleep", lambda seconds: slept.append(seconds))
    engine = simulated()
    node = {
        "name": "synthetic",
        "num_requests": 5,
        "arrival": "poisson",
        "rate": 0.05,  # one request every 20 s on average
        "prompt_len": {"dist": "fixed", "mean": 8},
        "output_len": {"dist": "fixed", "mean": 3},
    }
    requests = make_workload(node, engine.model_config.vocab_size)
    serve(engine, requests)
    assert slept == []  # the arrivals span over a minute of virtual time: none of it waited
    last = max(r.arrival_time for r in requests)
    assert last > 30 and engine.now() >= last
    for record in engine.metrics.requests:
        assert record.first_scheduled_time >= record.arrival_time


def test_the_padded_backend_costs_more_on_mixed_lengths():
    prompts = [[5] * 40, [6] * 2]
    times = {}
    for attention in ("per_request", "padded"):
        llm = LLM(model="tiny", executor="simulated", attention=attention)
        llm.generate(prompts, SamplingParams(max_tokens=1))
        times[attention] = llm.engine.now()
    assert times["padded"] > times["per_request"]


def test_tensor_parallelism_is_checked():
    # the real executor checks the split before starting a worker (tests/executor/test_tensor_parallel.py)
    with pytest.raises(ConfigError, match="must divide the model's shape: its 4 attention heads"):
        LLM(model="tiny", tensor_parallel_size=3)
    with pytest.raises(ConfigError, match="must divide"):
        simulated(tensor_parallel_size=3)


def test_every_profile_loads_with_its_sources():
    assert profile_names() == ["a100-80g", "cpu-local", "h100-sxm", "h100-sxm-fa3", "h200", "l40s", "rtx-pro-6000"]
    for name in profile_names():
        profile = load_profile(name)
        assert profile.sources and profile.memory > 0 and profile.memory_bandwidth > 0
        assert 0 < profile.matmul_efficiency <= 1 and 0 < profile.bandwidth_efficiency <= 1
        assert profile.basis in ("measured", "datasheet")
    # the GPU profiles fitted to measured operator times say so, and where the data came from
    for name in ("a100-80g", "h100-sxm"):
        profile = load_profile(name)
        assert profile.basis == "measured" and "microsoft/vidur" in profile.sources["fitted"]
    rtx = load_profile("rtx-pro-6000")  # fitted to LLMServingSim's operator times in vLLM
    assert rtx.basis == "measured" and "casys-kaist/LLMServingSim" in rtx.sources["measured"]
    assert "kernel vllm-fa2" in rtx.sources["attention"] and rtx.attention_gqa_packing == 1
    assert load_profile("l40s").basis == "datasheet"
    assert load_profile("h200").basis == "measured" and "H200" in load_profile("h200").sources["basis"]
    fa3 = load_profile("h100-sxm-fa3")  # h100-sxm with FlashAttention 3's attention figures
    assert fa3.attention_gqa_packing == 2 and fa3.matmul_efficiency == load_profile("h100-sxm").matmul_efficiency
    h200 = load_profile("h200")
    # measured: 790 TFLOP/s of a 989 TFLOP/s peak; 4.3 TB/s of 4.8
    assert h200.flops("bfloat16") * h200.matmul_efficiency == pytest.approx(790e12, rel=0.01)
    assert h200.memory_bandwidth * h200.bandwidth_efficiency == pytest.approx(4.3e12, rel=0.01)
    with pytest.raises(ConfigError, match="unknown hardware profile 'h900'; known: a100-80g"):
        load_profile("h900")
    with pytest.raises(ConfigError, match="unknown hardware profile field"):
        load_profile(
            {"name": "x", "memory": 1, "peak_flops": {}, "memory_bandwidth": 1, "tflops": 3}
        )


def test_a_simulated_run_writes_the_usual_files(tmp_path):
    config = {
        "model": "tiny",
        "executor": "simulated",
        "hardware": "h100-sxm",
        "engine": {"dtype": "bfloat16"},
        "workload": {"name": "synthetic", "num_requests": 4},
        "run": {"progress": False},
    }
    result = run_config(config)
    save_run(tmp_path, result, config, {})
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["config"]["executor"] == "simulated" and saved["summary"]["requests"] == 4
    assert (tmp_path / "steps.csv").is_file() and (tmp_path / "requests.csv").is_file()
    # the provenance names the clock and the whole hardware profile the times came from
    executor = saved["provenance"]["executor"]
    assert executor["virtual_clock"] is True and executor["tensor_parallel_size"] == 1
    assert executor["hardware"]["name"] == "h100-sxm"
    assert executor["hardware"]["memory_bandwidth"] == 3.35e12
    assert "datasheet" in executor["hardware"]["sources"]["peaks"]
    # and what kind of profile it is: h100-sxm is fitted to measured GPU operator times
    assert executor["hardware"]["basis"] == "measured"


def test_a_real_run_records_a_wall_clock(tmp_path):
    config = {"model": "tiny", "workload": {"name": "synthetic", "num_requests": 2},
              "run": {"progress": False}}  # fmt: skip
    result = run_config(config)
    assert result.provenance["executor"] == {"virtual_clock": False}


def test_static_batch_timeout_reads_the_virtual_clock():
    engine = build_engine(
        {"model": "tiny", "executor": "simulated", "scheduler": {"name": "static", "batch_size": 4,
                                                                 "batch_timeout": 5.0}}
    )  # fmt: skip
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True), request_id="a")
    engine.step()
    assert not engine.metrics.steps  # waits for its batch: 5 s of virtual time
    engine.sleep(5.0)
    engine.step()
    assert engine.metrics.steps


def test_the_batched_stand_in_tokens_equal_the_scalar_ones():
    import numpy as np

    from servelab.executor.stand_in import sequence_key, stand_in_token, stand_in_tokens

    keys = [sequence_key(f"r{i}", i % 3) for i in range(50)]
    positions = list(range(0, 5000, 100))
    batched = stand_in_tokens(np.array(keys, dtype=np.uint64), np.array(positions), 997)
    assert batched.tolist() == [stand_in_token(k, p, 997) for k, p in zip(keys, positions)]
    assert len(set(batched.tolist())) > 40  # spread over the vocabulary


def test_logprobs_requests_run_on_the_simulated_executor():
    """A request asking for logprobs is served (stand-in tokens drawn uniformly:
    every token's logprob is -log(vocab)), not half-added and then failed."""
    import math

    engine = simulated()
    vocab = engine.model_config.vocab_size
    request_id = engine.add_request([1, 2, 3], SamplingParams(max_tokens=3, logprobs=2))
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    (output,) = outputs
    assert output.request_id == request_id and output.error is None
    rows = output.outputs[0].logprobs
    assert [row["token_id"] for row in rows] == output.outputs[0].token_ids
    for row in rows:
        assert row["logprob"] == pytest.approx(-math.log(vocab))
        assert len(row["top"]) == 2 and row["top"][0][0] == row["token_id"]
    # the same through LLM.generate, beside a request that asks for none
    llm = LLM(model="tiny", executor="simulated")
    with_lp, without = llm.generate(
        [[1, 2, 3], [4, 5]],
        [SamplingParams(max_tokens=2, logprobs=0), SamplingParams(max_tokens=2)],
    )
    assert [len(r["top"]) for r in with_lp.outputs[0].logprobs] == [0, 0]
    assert not without.outputs[0].logprobs
