"""Every cost formula against values worked out by hand (see the comments) on a
toy shape: h=4, I=6, L=2, H=2 query heads, K=1 KV head, d=2, V=10, 2-byte elements.
One step: a prompt chunk of q=3 after s=2 cached tokens, one decode over 5 keys,
both sampling (T = 4 tokens, S = 2 rows)."""

from __future__ import annotations

import numpy as np
import pytest

from servelab.executor.cost_model import CostModel, Op, Shape, StepShape, attention_flops
from servelab.executor.hardware import HardwareProfile

SHAPE = Shape(
    hidden_size=4,
    intermediate_size=6,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    head_dim=2,
    vocab_size=10,
)
PROFILE = HardwareProfile(
    name="toy",
    memory=1000,
    peak_flops={"float32": 1000.0},
    memory_bandwidth=200.0,
    matmul_efficiency=0.5,  # 500 FLOP/s
    attention_efficiency=0.25,  # 250 FLOP/s
    bandwidth_efficiency=0.5,  # 100 B/s
    interconnect_bandwidth=50.0,
    interconnect_latency=0.02,
    host_link_bandwidth=50.0,
    launch_overhead=0.01,
    step_overhead=0.1,
    seq_overhead=0.05,
)


def step(padded: bool = False) -> StepShape:
    return StepShape(np.array([3.0]), np.array([2.0]), np.array([5.0]), sampling=2, padded=padded)


def model(tp: int = 1) -> CostModel:
    return CostModel(SHAPE, PROFILE, "float32", bytes_per_element=2, tp=tp)


def by_name(ops: list[Op]) -> dict[str, tuple[float, float]]:
    return {op.name: (op.flops, op.bytes) for op in ops}


def test_layer_operations():
    ops = by_name(model().layer_ops(step()))
    # qkv: m=4, n=(2+2)x2=8: 2x4x4x8 flops; 2 x (32 weights + 16 in + 32 out) bytes
    assert ops["qkv_proj"] == (256, 160)
    assert ops["o_proj"] == (128, 96)  # m=4, n=4: 2 x (16 + 16 + 16)
    assert ops["gate_up_proj"] == (384, 224)  # m=4, n=12: 2 x (48 + 16 + 48)
    assert ops["down_proj"] == (192, 128)  # m=6, n=4: 2 x (24 + 24 + 16)
    # 4 d H (q s + q(q+1)/2) = 16 x (6 + 6); bytes 2 d (2K(s+q) + 2Kq + 2Hq) = 4 x (10 + 6 + 12)
    assert ops["attention_prefill"] == (192, 112)
    # 4 d H x 5 keys; 4 x (2 x 5 + 2 x 1 + 2 x 2 x 1)
    assert ops["attention_decode"] == (80, 64)
    # element-wise, 2 bytes x T = 8 times: two norms 2 x 2h = 16, two adds 2 x 3h = 24,
    # RoPE read + write (H + K) d = 2 x 6, SiLU x up 3I = 18
    assert ops["rms_norm"] == (0, 8 * 16) and ops["residual_add"] == (0, 8 * 24)
    assert ops["rope"] == (0, 8 * 12) and ops["activation"] == (0, 8 * 18)


def test_attention_flops_is_the_causal_sum():
    # a chunk of 3 after 2 cached: queries see 3, 4 and 5 keys -> 12 pairs x 4 d H (d=2, H=2)
    assert attention_flops([3], [2], head_dim=2, heads=2) == 12 * 16
    assert attention_flops([1, 1], [0, 9], head_dim=1, heads=1) == 4 * (1 + 10)


def test_step_operations():
    ops = by_name(model().step_ops(step()))
    assert ops["embedding"] == (0, 32)  # 2 x 4 tokens x 4
    assert ops["final_norm"] == (0, 32)  # 2 x 2 x 2 rows x 4
    assert ops["lm_head"] == (160, 136)  # 2 x 2 x 4 x 10; 2 x (40 + 8 + 20)
    assert ops["sample"] == (0, 40)  # 2 x 2 x 10


def test_a_row_verifying_drafts_is_one_decode_of_several_queries():
    """A decode row with 2 drafts: 3 query tokens at positions 2..4, 5 keys in all. Its
    attention does a 3-token chunk's work (queries see 3, 4 and 5 keys: 12 pairs), in
    the decode op; the LM head reads 3 rows of logits, one per query."""
    verify = StepShape(np.zeros(0), np.zeros(0), np.array([5.0]), sampling=3,
                       decode_q=np.array([3.0]))  # fmt: skip
    ops = by_name(model().layer_ops(verify))
    assert "attention_prefill" not in ops
    # 4 d H x 12 pairs; 2 d (2K x 5 keys + 2K x 3 new + 2H x 3 queries) = 4 x (10 + 6 + 12)
    assert ops["attention_decode"] == (192, 112)
    assert ops["qkv_proj"] == (2 * 3 * 4 * 8, 2 * (32 + 12 + 24))  # T = 3 tokens
    assert by_name(model().step_ops(verify))["lm_head"] == (2 * 3 * 4 * 10, 2 * (40 + 12 + 30))
    assert verify.num_tokens == 3 and verify.num_seqs == 1
    rows = {op.name: op.rows for op in model().layer_ops(verify)}
    assert rows["attention_decode"] == 3  # the curve reads its query tokens
    # step_time prices what the ops say (decode rows with queries take the general path)
    cost = model()
    layer = sum(cost.op_time(op) for op in cost.layer_ops(verify))
    once = sum(cost.op_time(op) for op in cost.step_ops(verify))
    assert cost.step_time(verify) == pytest.approx(2 * layer + once + cost.host_time(verify))
    assert cost.device_time(verify) == pytest.approx(2 * layer + once)
    # the padded backend reads its query tokens as the row's length
    padded = StepShape(np.zeros(0), np.zeros(0), np.array([5.0, 2.0]), sampling=4,
                       padded=True, decode_q=np.array([3.0, 1.0]))  # fmt: skip
    # n=2 x max_q=3 x max_k=5 x 4 d H; 2 d (2K n max_k + 2K T + 2H n max_q), T = 4
    assert by_name(cost.layer_ops(padded))["attention_padded"] == (480, 4 * (20 + 8 + 24))


def test_op_time_is_the_roofline_plus_a_launch():
    cost = model()
    assert cost.op_time(Op("x", "matmul", 1000, 10)) == pytest.approx(2.0 + 0.01)  # compute bound
    assert cost.op_time(Op("x", "matmul", 10, 1000)) == pytest.approx(10.0 + 0.01)  # memory bound
    assert cost.op_time(Op("x", "attention", 500, 0)) == pytest.approx(2.0 + 0.01)
    assert cost.op_time(Op("x", "memory", 0, 300, launches=3)) == pytest.approx(3.0 + 0.03)


def test_the_efficiency_curve_slows_small_ops_only():
    import dataclasses

    curved = dataclasses.replace(PROFILE, matmul_half_rows=4.0, attention_half_rows=1.0)
    cost = CostModel(SHAPE, curved, "float32", bytes_per_element=2)
    # 4 rows against half 4: half of 500 FLOP/s, so 1000 FLOPs take 4 s, not 2
    assert cost.op_time(Op("x", "matmul", 1000, 10, rows=4)) == pytest.approx(4.0 + 0.01)
    # 12 rows: 12 / 16 of it, 375 FLOP/s
    assert cost.op_time(Op("x", "matmul", 1500, 10, rows=12)) == pytest.approx(4.0 + 0.01)
    # attention, 1 row against half 1: 125 FLOP/s
    assert cost.op_time(Op("x", "attention", 500, 0, rows=1)) == pytest.approx(4.0 + 0.01)
    # memory-bound ops and row-less ops are untouched
    assert cost.op_time(Op("x", "matmul", 10, 1000, rows=1)) == pytest.approx(10.0 + 0.01)
    assert cost.op_time(Op("x", "memory", 0, 300, launches=3, rows=1)) == pytest.approx(3.03)
    # the ops carry their rows: a projection its tokens, attention its query rows
    rows = {op.name: op.rows for op in cost.layer_ops(step())}
    assert (
        rows["qkv_proj"] == 4 and rows["attention_prefill"] == 3 and rows["attention_decode"] == 1
    )


def test_step_time_adds_layers_step_ops_and_host_work():
    # per layer: qkv 1.6, o 0.96, gate_up 2.24, down 1.28, prefill attention 1.12, decode
    # attention 0.64 (all memory bound), element-wise 5.6; + 7 + 5 more launches of 0.01
    layer = 1.6 + 0.96 + 2.24 + 1.28 + 1.12 + 0.64 + 5.6 + 12 * 0.01
    once = 0.32 + 0.32 + 1.36 + 0.4 + 4 * 0.01  # embedding, norm, lm_head, sample
    host = 0.1 + 0.05 * 2
    assert model().step_time(step()) == pytest.approx(2 * layer + once + host)


def test_tensor_parallel_share_and_all_reduce():
    cost = model(tp=2)
    ops = by_name(cost.layer_ops(step()))
    # per GPU: 1 query head, half a KV head: qkv n = (1 + 1) x 2 = 4
    assert ops["qkv_proj"] == (2 * 4 * 4 * 4, 2 * (16 + 16 + 16))
    assert ops["down_proj"] == (2 * 4 * 3 * 4, 2 * (12 + 12 + 16))  # I/p = 3 rows
    # ring all-reduce of 2 bytes x 4 tokens x 4: 0.02 + 2 x 1/2 x 32 / 50
    assert cost.all_reduce_time(4) == pytest.approx(0.02 + 0.64)
    assert model(tp=1).all_reduce_time(4) == 0.0
    single, double = model(tp=1).step_time(step()), cost.step_time(step())
    layer_ops = sum(cost.op_time(op) for op in cost.layer_ops(step()))
    once = sum(cost.op_time(op) for op in cost.step_ops(step()))
    # once a step: the embeddings' all-reduce (0.66, as a layer's), and rank 0's gather
    # of the other rank's half of S = 2 rows of V = 10 logits: 0.02 + 1/2 x 2 x 2 x 10 / 50
    assert cost.gather_time(2) == pytest.approx(0.02 + 0.4)
    assert model(tp=1).gather_time(2) == 0.0 and cost.gather_time(0) == 0.0
    assert double == pytest.approx(2 * (layer_ops + 2 * 0.66) + once + 0.66 + 0.42 + 0.2)
    assert double != single


def test_the_padded_backend_pays_for_its_padding():
    ops = by_name(model().layer_ops(step(padded=True)))
    assert "attention_prefill" not in ops and "attention_decode" not in ops
    # n=2 sequences x max_q=3 x max_k=5 x 4 d H; 2 d (2K n max_k + 2K T + 2H n max_q)
    assert ops["attention_padded"] == (4 * 2 * 2 * 2 * 3 * 5, 4 * (20 + 8 + 24))


def test_copy_time():
    cost = model()
    assert cost.copy_time(100, 0) == pytest.approx(100 / 50 + 0.01)  # host link
    assert cost.copy_time(0, 10) == pytest.approx(2 * 10 / 100 + 0.01)  # read + write
    assert model(tp=2).copy_time(100, 0) == pytest.approx(50 / 50 + 0.01)
    assert cost.copy_time(0, 0) == 0.0


def test_fixed_costs_per_call():
    import dataclasses

    fixed = dataclasses.replace(PROFILE, matmul_overhead=0.3, attention_prefill_overhead=0.5,
                                attention_decode_overhead=0.7)  # fmt: skip
    cost = CostModel(SHAPE, fixed, "float32", bytes_per_element=2)
    ops = {op.name: op for op in cost.layer_ops(step())}
    # qkv: memory bound 160 B / 100 B/s = 1.6, one launch 0.01, and the matmul's 0.3
    assert cost.op_time(ops["qkv_proj"]) == pytest.approx(1.6 + 0.01 + 0.3)
    # prefill attention 112 B -> 1.12 and its 0.5; decode 64 B -> 0.64 and its 0.7
    assert cost.op_time(ops["attention_prefill"]) == pytest.approx(1.12 + 0.01 + 0.5)
    assert cost.op_time(ops["attention_decode"]) == pytest.approx(0.64 + 0.01 + 0.7)
    # the padded backend's one call is a prefill's when any query is longer than one token
    padded = {op.name: op for op in cost.layer_ops(step(padded=True))}
    assert padded["attention_padded"].call == "prefill"
    # element-wise ops carry none: 128 B of the norms -> 1.28, two launches
    assert cost.op_time(ops["rms_norm"]) == pytest.approx(1.28 + 0.02)


def test_element_wise_kernels_have_their_own_bandwidth_and_wave():
    import dataclasses

    elementwise = dataclasses.replace(
        PROFILE, elementwise_efficiency=0.25, kernel_efficiency={"rope": 0.1},
        elementwise_full_rows=8.0,
    )  # fmt: skip
    cost = CostModel(SHAPE, elementwise, "float32", bytes_per_element=2)
    ops = {op.name: op for op in cost.layer_ops(step())}
    # 4 rows against a wave of 8: they cost as 8 rows do, twice their bytes.
    # norms: 128 B x 2 / (200 x 0.25 = 50 B/s) = 5.12, two launches
    assert cost.op_time(ops["rms_norm"]) == pytest.approx(5.12 + 0.02)
    # RoPE has its own efficiency: 96 B x 2 / (200 x 0.1 = 20 B/s) = 9.6
    assert cost.op_time(ops["rope"]) == pytest.approx(9.6 + 0.01)
    # 16 rows fill the wave: 16 x (2 bytes x 18) = 576 B / 50 B/s
    assert cost.op_time(Op("activation", "elementwise", 0, 576, rows=16)) == pytest.approx(11.53)
    # matmuls and other memory ops keep the bandwidth efficiency, no wave
    assert cost.op_time(ops["qkv_proj"]) == pytest.approx(1.6 + 0.01)
    assert cost.op_time(Op("x", "memory", 0, 300, rows=1)) == pytest.approx(3.01)


def test_the_collective_bandwidth_curve_slows_small_messages():
    import dataclasses

    curved = dataclasses.replace(PROFILE, interconnect_half_bytes=32.0)
    cost = CostModel(SHAPE, curved, "float32", bytes_per_element=2, tp=2)
    # 32 bytes against half 32: 25 B/s, so 0.02 + 2 x 1/2 x 32 / 25
    assert cost.all_reduce_time(4) == pytest.approx(0.02 + 1.28)
    # 8 x larger: 256 / (256 + 32) of 50 B/s
    assert cost.all_reduce_time(32) == pytest.approx(0.02 + 256 / (50 * 256 / 288))


def test_the_collective_floor_grows_per_device_and_the_curve_takes_an_exponent():
    import dataclasses

    from servelab.lab.calibrate_vidur import collective_times

    shaped = dataclasses.replace(
        PROFILE, interconnect_half_bytes=32.0, interconnect_curve_exponent=0.5,
        interconnect_latency_per_device=0.005,
    )  # fmt: skip
    # 4 devices: floor 0.02 + 3 x 0.005; 32 bytes against half 32: (1/2) ** 0.5 of 50 B/s;
    # a ring all-reduce moves 2 x 3/4 x 32 bytes
    four = CostModel(SHAPE, shaped, "float32", bytes_per_element=2, tp=4)
    assert four.all_reduce_time(4) == pytest.approx(0.035 + 48 / (50 * 0.5**0.5))
    # the gather of S = 2 rows of V = 10 logits: 40 bytes, one pass of 3/4
    assert four.gather_time(2) == pytest.approx(0.035 + 30 / (50 * (40 / 72) ** 0.5))
    # the arrays the fits price agree with the scalar form, one and two passes
    data, devices = np.array([32.0, 40.0, 1e6]), np.array([4.0, 4.0, 8.0])
    scalar = [
        [collective_time_of(shaped, int(p), b, passes) for b, p in zip(data, devices)]
        for passes in (1, 2)
    ]
    for passes in (1, 2):
        np.testing.assert_allclose(
            collective_times(shaped, data, devices, passes), scalar[passes - 1], rtol=1e-12
        )


def collective_time_of(profile, p, data, passes):
    from servelab.executor.cost_model import collective_time

    return collective_time(profile, p, data, passes)


def test_a_profile_without_the_new_collective_figures_prices_as_the_plain_ring():
    """Defaults: no per-device floor, exponent 1, so the formula is the one before them."""
    cost = CostModel(SHAPE, PROFILE, "float32", bytes_per_element=2, tp=8)
    assert PROFILE.interconnect_latency_per_device == 0.0
    assert PROFILE.interconnect_curve_exponent == 1.0
    assert cost.all_reduce_time(4) == 0.02 + 2 * 7 / 8 * 32 / 50
