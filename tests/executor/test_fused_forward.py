"""`FusedForward`, the CUDA forward with the layer's small ops fused, run on the
CPU with the Triton kernels interpreted: its decode steps equal the torch
forward's (hidden states and K/V), its tokens equal transformers' in float64,
and a decode step launches at most ten kernels per layer (the torch forward
launches about forty)."""

from __future__ import annotations

import pytest
import torch

from servelab.executor.forward import TorchForward, choose_forward
from servelab.executor.fused_forward import FusedForward
from servelab.kernels import triton_fused
from servelab.plugins.attention import triton_kernels
from tests.executor.decode_scenes import (
    TRITON_DEVICE,
    assert_same_decode,
    make_scene,
    skip_unless_triton_interpreted,
)
from tests.executor.launch_count import count_launches
from tests.executor.test_device_path import oracle_llm, oracle_tokens

MAX_LAUNCHES_PER_LAYER = 10


def fused_candidate(scene):
    fused = FusedForward(scene.model)
    return lambda ids, meta: fused.forward(
        ids, meta.positions, scene.kv.layers, scene.backend, scene.backend.plan(meta)
    )


@pytest.mark.gpu_path
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_fused_decode_equals_the_torch_forward(dtype, tol):
    scene = make_scene(TRITON_DEVICE, dtype, "triton_paged")
    assert_same_decode(scene, fused_candidate(scene), tol=tol)


def test_fused_forward_tokens_equal_transformers():
    skip_unless_triton_interpreted()  # a CPU engine with triton_paged
    case, llm = oracle_llm("triton_paged")
    llm.engine.executor.runner.model_forward = FusedForward(llm.engine.executor.model)
    count = 4
    assert oracle_tokens(llm, case, count) == case.expected[:count]


def decode_launches(monkeypatch, scene, forward) -> dict:
    ids, meta = scene.steps[0]
    plan = scene.backend.plan(meta)  # once per step, not per layer: outside the count
    with torch.inference_mode(), count_launches(monkeypatch, triton_kernels, triton_fused) as c:
        forward(ids, meta.positions, scene.kv.layers, scene.backend, plan)
    return dict(c)


def per_layer(counts: dict, layers: int, once: int) -> float:
    """Launches per layer: all of them less the `once` per step (embedding,
    final norm, RoPE gathers), over the layers."""
    return (sum(counts.values()) - once) / layers


@pytest.mark.gpu_path
def test_a_fused_decode_step_launches_at_most_ten_kernels_per_layer(monkeypatch):
    # bfloat16, the CUDA default: the torch path's RMSNorm is then seven ops
    scene = make_scene(TRITON_DEVICE, torch.bfloat16, "triton_paged")
    layers = scene.model.config.num_layers
    fused = decode_launches(monkeypatch, scene, FusedForward(scene.model).forward)
    torch_ops = decode_launches(monkeypatch, scene, TorchForward(scene.model).forward)
    print(f"torch: {torch_ops}\nfused: {fused}")
    fused_per_layer = per_layer(fused, layers, once=2)  # embedding, final add + norm
    torch_per_layer = per_layer(torch_ops, layers, once=1 + 2 + 5)  # embedding, 2 gathers, norm
    print(f"launches per layer: torch {torch_per_layer:.1f}, fused {fused_per_layer:.1f}")
    assert fused["aten.embedding"] == 1 and fused["triton._add_rms_norm_kernel"] == 2 * layers + 1
    assert fused_per_layer <= MAX_LAUNCHES_PER_LAYER, fused
    assert torch_per_layer > 3 * MAX_LAUNCHES_PER_LAYER, torch_ops  # the counter sees the ops
    assert fused["triton._paged_attention_kernel"] == layers
    assert fused["triton._qk_norm_rope_kernel"] == layers


def test_cuda_models_take_the_fused_forward(monkeypatch):
    scene = make_scene("cpu", torch.float32, "per_request")
    monkeypatch.setattr(type(scene.model), "device", property(lambda m: torch.device("cuda")))
    assert isinstance(choose_forward(scene.model, "auto", compile=False), FusedForward)
    assert isinstance(choose_forward(scene.model, "off", compile=True), TorchForward)
