"""A decode scene both the CPU and the CUDA tests of the decode path use: a tiny
model whose KV cache holds prefilled prompts, two decode steps, and the checks
that a candidate (a graph replay, or its eager stand-in) matches the plain step."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from servelab.engine.build import attention_backend
from servelab.executor.cuda_graphs import (
    DecodeGraphRunner,
)
from servelab.executor.kv_cache import KVCache
from servelab.model.loader import load_model
from servelab.model.transformer import Transformer
from servelab.step.metadata import AttentionMetadata

HAS_CUDA = torch.cuda.is_available()
# triton_paged runs compiled where CUDA is, interpreted on CPU tensors elsewhere
TRITON_DEVICE = "cuda" if HAS_CUDA else "cpu"
cuda_only = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
BACKENDS = ("padded", "per_request", "flash_varlen", "triton_paged")


def skip_unless_triton_interpreted() -> None:
    """Skips a test that runs `triton_paged` on CPU tensors where its kernels are
    compiled (a CUDA machine without TRITON_INTERPRET): they need CUDA tensors."""
    from servelab.plugins.attention.triton_paged import kernels

    if not kernels().INTERPRETED:
        pytest.skip("triton_paged on the CPU needs the Triton interpreter; kernels compiled here")


@dataclass
class DecodeScene:
    """A tiny model whose KV cache holds prefilled prompts, and two decode steps:
    `steps[0]` for every sequence, `steps[1]` for the first few only (so the
    second step's padding rows held real sequences in the first)."""

    model: Transformer
    backend: object
    kv: KVCache
    steps: list[tuple[torch.Tensor, AttentionMetadata]]
    block_size: int
    max_model_len: int

    def forward(self, ids, positions, plan):
        return self.model(ids, positions, self.kv.layers, self.backend, plan)

    def eager(self, ids, meta):
        return self.forward(ids, meta.positions, self.backend.plan(meta))


def make_scene(device, dtype, backend_name, prompt_lens=(3, 9, 1, 14, 6), second=3, seed=0):
    if backend_name == "triton_paged" and torch.device(device).type == "cpu":
        skip_unless_triton_interpreted()
    model, config, _ = load_model("tiny", dtype, device, seed=0)
    backend = attention_backend(backend_name, config)
    rng = random.Random(seed)
    block_size, max_model_len = 4, 32
    blocks = [-(-(p + 2) // block_size) for p in prompt_lens]  # room for two decode tokens
    num_blocks = sum(blocks) + 3  # spare blocks nobody may touch
    physical = rng.sample(range(num_blocks), num_blocks)
    tables, used = [], 0
    for n in blocks:
        tables.append(physical[used : used + n])
        used += n
    kv = KVCache(
        config.num_layers,
        num_blocks,
        block_size,
        config.num_kv_heads,
        config.head_dim,
        dtype,
        torch.device(device),
    )
    scene = DecodeScene(model, backend, kv, [], block_size, max_model_len)
    lens = list(prompt_lens)
    prompt_ids = [rng.randrange(config.vocab_size) for _ in range(sum(lens))]
    meta = AttentionMetadata.from_lists(lens, lens, tables, block_size, device=device)
    ids = torch.tensor(prompt_ids, device=device)
    with torch.inference_mode():
        scene.eager(ids, meta)  # prefill: the cache now holds every prompt
    for count in (len(lens), second):
        seq_lens = [n + 1 for n in lens[:count]]
        meta = AttentionMetadata.from_lists(
            [1] * count, seq_lens, tables[:count], block_size, device=device
        )
        ids = torch.tensor([rng.randrange(config.vocab_size) for _ in range(count)], device=device)
        scene.steps.append((ids, meta))
        lens[:count] = seq_lens
    return scene


def written_slots(scene) -> torch.Tensor:
    return torch.cat([meta.slot_mapping for _, meta in scene.steps]).cpu()


def assert_near(have: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    """Equal when `tol` is 0, else ||have - want|| / ||want|| <= tol (no NaN passes)."""
    assert have.shape == want.shape
    if tol == 0:
        assert torch.equal(have, want)
        return
    have, want = have.double().cpu(), want.double().cpu()
    err = float((have - want).norm() / want.norm())
    assert err <= tol, f"relative error {err:.2e} > {tol:.0e}"


def assert_same_decode(scene, run_candidate, tol):
    """Runs both steps eagerly, then through `run_candidate` from the same cache:
    same hidden states and K/V at the written slots (to `tol`), every other slot
    untouched (exactly)."""
    pool = scene.kv.device_pool
    before = pool.clone()
    with torch.inference_mode():
        expected = [scene.eager(ids, meta).clone() for ids, meta in scene.steps]
        expected_pool = pool.clone()
        pool.copy_(before)
        got = [run_candidate(ids, meta).clone() for ids, meta in scene.steps]
    for want, have in zip(expected, got, strict=True):
        assert_near(have, want, tol)
    slots = written_slots(scene)
    flat = lambda t: t.flatten(2, 3).cpu()  # [2, layers, slots, heads, dim]
    untouched = torch.ones(flat(pool).shape[2], dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(flat(pool)[:, :, untouched], flat(before)[:, :, untouched]), (
        "a padding row wrote K/V"
    )
    assert_near(flat(pool)[:, :, slots], flat(expected_pool)[:, :, slots], tol)


# ---------------------------------------------------------------- the runner on the CPU


def scene_runner(scene, device, **options) -> DecodeGraphRunner:
    """A graph runner over a scene's forward and backend: 8 sequences, the
    scene's length and block size."""
    return DecodeGraphRunner(
        scene.forward,
        scene.backend,
        max_num_seqs=8,
        max_model_len=scene.max_model_len,
        block_size=scene.block_size,
        device=device,
        **options,
    )


# ---------------------------------------------------------------- a CPU stand-in for CUDA graphs


class ForwardReplay:
    """A CPU stand-in for a CUDA graph: "capture" records the call and runs it
    once, its result becoming the graph's output buffer; `replay()` reruns the
    recorded call on the same static inputs with the same plan and copies the
    result into that buffer, as a graph replays its kernels on fixed addresses.
    A plan that read anything but the static device tensors would go stale here
    as in a real graph."""

    def __init__(self, call):
        self.call = call
        self.output = call()
        self.num_replays = 0

    def replay(self):
        self.output.copy_(self.call())
        self.num_replays += 1


class CpuReplayRunner(DecodeGraphRunner):
    """`DecodeGraphRunner` that "captures" on any device with `ForwardReplay`;
    `captured` lists the buckets in the order they were captured."""

    def _device_has_graphs(self):
        return True

    def _capture_graph(self, input_ids, positions, plan):
        self.__dict__.setdefault("captured", []).append(input_ids.shape[0])
        graph = ForwardReplay(lambda: self.forward(input_ids, positions, plan))
        return graph, graph.output
