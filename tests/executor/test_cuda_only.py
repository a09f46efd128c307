"""The device path on a CUDA device (the module is skipped elsewhere): graph
capture and replay against eager, greedy tokens on CUDA against the CPU for every
attention backend whose `check()` accepts the setup, every backend's attention
at the Qwen3-0.6B head shape in bf16 and float32 against a float64 reference,
and the device readings."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from servelab import LLM, SamplingParams
from servelab.engine.build import attention_backend
from servelab.errors import ConfigError
from servelab.executor.cuda_graphs import (
    DecodeGraphRunner,
)
from servelab.executor.device_memory import (
    GiB,
    device_memory_budget,
    estimate_activation_bytes,
    model_weight_bytes,
)
from servelab.executor.staging import StepStaging
from servelab.model.config import named_config
from servelab.step.metadata import AttentionMetadata
from tests.executor.decode_scenes import (
    BACKENDS,
    assert_same_decode,
    cuda_only,
    make_scene,
    scene_runner,
)

pytestmark = [pytest.mark.cuda, cuda_only]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_replay_matches_eager(dtype):
    scene = make_scene("cuda", dtype, "triton_paged")
    runner = scene_runner(scene, "cuda")
    assert runner.enabled, runner.disabled_reason
    before = scene.kv.device_pool.clone()
    runner.capture()
    assert sorted(runner.graphs) == [1, 2, 4, 8]
    assert torch.equal(scene.kv.device_pool, before), "capture wrote K/V"
    assert_same_decode(scene, runner.run, tol=1e-5 if dtype == torch.float32 else 1e-2)
    assert runner.num_replays == 2 and runner.num_eager == 0
    prefill = AttentionMetadata.from_lists([2], [2], [[0]], scene.block_size, device="cuda")
    with torch.inference_mode():
        runner.run(torch.tensor([1, 2], device="cuda"), prefill)
    assert runner.num_eager == 1  # a prefill never replays


def test_graph_unsafe_backend_runs_eagerly_on_cuda():
    scene = make_scene("cuda", torch.float32, "per_request")
    runner = DecodeGraphRunner(
        scene.forward, scene.backend, max_num_seqs=8, max_model_len=32, block_size=4, device="cuda"
    )
    assert "per_request" in runner.disabled_reason
    runner.capture()
    assert not runner.graphs
    assert_same_decode(scene, runner.run, tol=0)


def greedy_tokens(attention, device, prompts, max_tokens=12):
    llm = LLM(model="tiny", attention=attention, device=device, dtype="float32", max_model_len=128)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params)]


@pytest.mark.parametrize("attention", BACKENDS)
def test_greedy_tokens_on_cuda_equal_the_cpu(attention):
    rng = random.Random(3)
    prompts = [[rng.randrange(2, 512) for _ in range(rng.randint(3, 40))] for _ in range(5)]
    try:
        on_cuda = greedy_tokens(attention, "cuda", prompts)
    except ConfigError as err:  # the backend's check() refuses float32 on CUDA
        pytest.skip(f"{attention}: {err}")
    assert on_cuda == greedy_tokens("per_request", "cpu", prompts)


@pytest.mark.usefixtures("test_proposers")
@pytest.mark.parametrize("attention", BACKENDS)
def test_verified_drafts_on_cuda_give_the_cpu_tokens(attention):
    """Rows of 1 + drafts tokens through every backend on CUDA (n-gram lookup: a tiny
    random model repeats itself, so drafts are kept and rejected): the CPU's tokens
    without a proposer."""
    rng = random.Random(5)
    prompts = [[rng.randrange(2, 40) for _ in range(rng.randint(3, 40))] for _ in range(5)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    try:
        llm = LLM(model="tiny", attention=attention, device="cuda", dtype="float32",
                  max_model_len=128, proposer={"name": "ngram", "k": 3, "min_n": 1})  # fmt: skip
    except ConfigError as err:
        pytest.skip(f"{attention}: {err}")
    got = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
    assert got == greedy_tokens("per_request", "cpu", prompts, max_tokens=24)
    assert llm.engine.scheduler.stats()["spec_num_accepted_tokens"] > 0


@pytest.mark.usefixtures("test_proposers")
def test_rejection_sampling_runs_on_cuda():
    """Drafts with probabilities verified on the device (the target's distributions,
    the uniforms and the residual draws all on CUDA), seeded: the same tokens twice."""
    node = {"name": "fixed_distribution", "k": 3, "weights": {40: 0.5, 41: 0.5}, "mass": 0.9}
    params = [SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=s,
                             logit_bias={40: 9.0, 41: 8.5}) for s in range(6)]  # fmt: skip

    def run():
        llm = LLM(model="tiny", device="cuda", dtype="float32", max_model_len=128, proposer=node)
        tokens = [o.outputs[0].token_ids for o in llm.generate([[5, 6, 7]] * 6, params)]
        return tokens, llm.engine.scheduler.stats()["spec_num_accepted_tokens"]

    first, kept = run()
    assert kept > 0 and run()[0] == first


def dense_reference(q, keys, values, context_len, scale):
    """One sequence in float64 from unpaged K/V: q [Q, H, D], keys/values [S, KVH, D]."""
    group = q.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1)
    v = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    query_pos = context_len + torch.arange(q.shape[0])
    hidden = torch.arange(k.shape[0])[None, :] > query_pos[:, None]
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(hidden, float("-inf")).softmax(-1), v)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("spec", [*BACKENDS, {"name": "flash_varlen", "impl": "torch"}], ids=str)
def test_backend_attention_on_cuda_at_qwen3_heads(spec, dtype):
    """A mixed batch (decodes, a chunk mid-context, a whole prompt) at 16 query /
    8 KV heads, head_dim 128, against a float64 dense reference."""
    config = named_config("qwen3-0.6b")
    backend = attention_backend(spec, config)
    block_size, device = 16, torch.device("cuda")
    try:
        backend.check(SimpleNamespace(block_size=block_size, name="paged"), device, dtype)
    except ConfigError as err:
        pytest.skip(str(err))
    query_lens, context_lens = [1, 1, 37, 120], [300, 17, 64, 0]
    seq_lens = [q + c for q, c in zip(query_lens, context_lens)]
    gen = torch.Generator().manual_seed(0)
    nkv, hd = config.num_kv_heads, config.head_dim
    blocks = [-(-s // block_size) for s in seq_lens]
    physical = torch.randperm(sum(blocks) + 2, generator=gen).tolist()
    tables, used = [], 0
    for n in blocks:
        tables.append(physical[used : used + n])
        used += n
    cache = torch.zeros(sum(blocks) + 2, block_size, nkv, hd, dtype=dtype, device=device)
    k_cache, v_cache = cache.clone(), cache.clone()
    keys = [torch.randn(s, nkv, hd, generator=gen).to(dtype) for s in seq_lens]
    values = [torch.randn(s, nkv, hd, generator=gen).to(dtype) for s in seq_lens]
    for table, c, k, v in zip(tables, context_lens, keys, values):
        for pos in range(c):
            k_cache[table[pos // block_size], pos % block_size] = k[pos].to(device)
            v_cache[table[pos // block_size], pos % block_size] = v[pos].to(device)
    q = torch.randn(sum(query_lens), config.num_heads, hd, generator=gen).to(dtype)
    new_k = torch.cat([k[c:] for k, c in zip(keys, context_lens)])
    new_v = torch.cat([v[c:] for v, c in zip(values, context_lens)])
    meta = AttentionMetadata.from_lists(query_lens, seq_lens, tables, block_size, device=device)
    plan = backend.plan(meta)
    out = backend.forward(
        q.to(device), new_k.to(device), new_v.to(device), (k_cache, v_cache), plan
    )
    starts = np.cumsum([0, *query_lens])
    want = torch.cat(
        [
            dense_reference(q[a:b], k, v, c, config.attention_scale)
            for a, b, k, v, c in zip(starts, starts[1:], keys, values, context_lens)
        ]
    )
    err = (out.double().cpu() - want).norm() / want.norm()
    assert err < (2e-2 if dtype == torch.bfloat16 else 1e-3), float(err)


def test_device_memory_budget_reads_the_device():
    weights = torch.empty(256 * 1024**2, dtype=torch.uint8, device="cuda")  # stands for weights
    budget = device_memory_budget("cuda", 0.5, activation_peak_bytes=GiB)
    assert budget.total_bytes == torch.cuda.get_device_properties(0).total_memory
    assert budget.weights_bytes >= weights.numel()
    assert budget.kv_bytes <= int(budget.total_bytes * 0.5) - budget.weights_bytes - GiB
    with pytest.raises(ConfigError, match="no room"):
        _ = device_memory_budget("cuda", 1e-6, activation_peak_bytes=GiB).kv_bytes


def test_staging_pins_and_uploads_to_cuda():
    staging = StepStaging("cuda", capacity_bytes=32)
    assert staging.host.is_pinned()
    for step in range(3):
        staging.begin()
        values = list(range(step, step + 100))
        staging.put("positions", values, torch.int64)
        staging.put("seq_lens", values, torch.int32)
        out = staging.upload()
        assert out["positions"].device.type == "cuda"
        assert out["positions"].tolist() == values and out["seq_lens"].tolist() == values


def test_engine_replays_decode_graphs_on_cuda():
    rng = random.Random(5)
    prompts = [[rng.randrange(2, 512) for _ in range(rng.randint(3, 40))] for _ in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    llm = LLM(
        model="tiny",
        attention="triton_paged",
        device="cuda",
        dtype="float32",
        max_model_len=128,
        max_num_seqs=8,
        cuda_graphs=True,
    )
    runner = llm.engine.executor.runner
    assert runner.graphs_status.startswith("captured"), runner.graphs_status
    on_cuda = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
    assert runner.graphs.num_replays > 0
    assert on_cuda == greedy_tokens("per_request", "cpu", prompts)


def test_gpu_memory_utilization_sizes_the_kv_cache_on_cuda():
    """total x utilization - weights - activation estimate, read from the real
    device; what this process held before loading is neither weights nor KV."""
    total = torch.cuda.get_device_properties(0).total_memory
    held = torch.cuda.memory_allocated()
    utilization = min(1.0, (held + 2 * GiB) / total)  # about 2 GiB for weights + KV
    llm = LLM(model="tiny", device="cuda", dtype="float32", gpu_memory_utilization=utilization)
    config = llm.engine.model_config
    # engine defaults: max_num_batched_tokens = max(2048, max_model_len), max_num_seqs 64
    activations = estimate_activation_bytes(config, 2048, 64, torch.float32)
    budget = int(total * utilization) - model_weight_bytes(config, torch.float32) - activations
    kv = llm.engine.executor.kv_cache.device_pool.nbytes
    # below: whole blocks only, and buffers loaded with the weights (RoPE tables) count as weights
    assert budget - 64 * 1024**2 < kv <= budget
