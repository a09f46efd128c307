"""Attention's kernel-block terms (`attention_stream_efficiency`, `attention_key_time`,
`attention_block_overhead`): hand-computed prices, and off by default."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from servelab.executor.cost_model import CostModel, Shape, StepShape, prefill_blocks
from servelab.executor.hardware import HardwareProfile

# d = 4, 2 query heads, 1 KV head; 1 byte per element
SHAPE = Shape(hidden_size=8, intermediate_size=8, num_layers=1, num_heads=2, num_kv_heads=1,
              head_dim=4, vocab_size=10)  # fmt: skip
PROFILE = HardwareProfile("toy", 1, {"x": 1e30}, 100.0, bandwidth_efficiency=1.0)


def _ops(profile, step):
    return {op.name: op for op in CostModel(SHAPE, profile, "x", 1).attention_ops(step)}


def test_a_decode_batch_counts_its_blocks_keys_and_streamed_bytes():
    step = StepShape(np.zeros(0), np.zeros(0), np.array([10.0, 30.0]), 2)
    op = _ops(PROFILE, step)["attention_decode"]
    # one block per query head of each sequence; every block streams K and V of its keys
    assert op.blocks == 2 * 2 and op.span == 20.0  # the mean sequence's keys
    assert op.streamed == 1 * 4 * 2 * 2 * 40


def test_a_prefill_chunk_is_tiles_of_128_rows_each_streaming_its_causal_keys():
    # 300 rows after 50 cached: tiles end at 128, 256, 300 -> keys 178, 306, 350
    streamed, span, blocks = prefill_blocks([300.0], [50.0], heads=2, bytes_per_head=4)
    assert blocks == 3 * 2 and span == 350.0
    assert streamed == 4 * 2 * 2 * (178 + 306 + 350)


def test_each_block_term_bounds_the_op_time():
    step = StepShape(np.zeros(0), np.zeros(0), np.array([10.0, 30.0]), 2)
    plain = CostModel(SHAPE, PROFILE, "x", 1)
    op = _ops(PROFILE, step)["attention_decode"]
    base = plain.op_time(op)  # DRAM bytes at 100 B/s
    assert base == pytest.approx(op.bytes / 100.0)
    stream = dataclasses.replace(PROFILE, attention_stream_efficiency=0.5)  # 50 B/s
    assert CostModel(SHAPE, stream, "x", 1).op_time(op) == pytest.approx(640 / 50)
    keys = dataclasses.replace(PROFILE, attention_key_time=1.0, attention_decode_overhead=0.5)
    assert CostModel(SHAPE, keys, "x", 1).op_time(op) == pytest.approx(20.0 + 0.5)
    blocks = dataclasses.replace(PROFILE, attention_block_overhead=10.0)
    assert CostModel(SHAPE, blocks, "x", 1).op_time(op) == pytest.approx(40.0)


def test_step_time_prices_decodes_as_attention_ops_does():
    profile = dataclasses.replace(PROFILE, attention_key_time=0.3, attention_block_overhead=0.2,
                                  attention_stream_efficiency=0.1, matmul_efficiency=1.0)  # fmt: skip
    model = CostModel(SHAPE, profile, "x", 1)
    step = StepShape(np.zeros(0), np.zeros(0), np.array([10.0, 30.0, 7.0]), 3)
    ops = model.layer_ops(step)
    total = sum(model.op_time(op) for op in ops) + model._once_time(step.num_tokens, 3)
    assert model.step_time(step) == pytest.approx(total + model.host_time(step))
    assert any(op.blocks for op in ops)


def test_the_terms_are_off_by_default():
    step = StepShape(np.array([64.0]), np.array([100.0]), np.array([10.0]), 2)
    for op in _ops(PROFILE, step).values():
        plain = CostModel(SHAPE, PROFILE, "x", 1)
        assert plain.op_time(op) == plain.seconds(op.kind, op.flops, op.bytes, op.rows,
                                                  op.launches, op.call, op.name)  # fmt: skip


def test_gqa_packing_streams_each_kv_head_once_in_the_steps_its_kernel_packs():
    # 2 query heads share the 1 KV head: packed, one block per sequence reading K/V once
    decodes = StepShape(np.zeros(0), np.zeros(0), np.array([10.0, 30.0]), 2)
    mixed = StepShape(np.array([4.0]), np.array([0.0]), np.array([10.0, 30.0]), 3)
    for packing, packed_alone, packed_mixed in ((0.0, False, False), (1.0, True, False),
                                                (2.0, True, True)):  # fmt: skip
        profile = dataclasses.replace(PROFILE, attention_gqa_packing=packing)
        alone = _ops(profile, decodes)["attention_decode"]
        beside = _ops(profile, mixed)["attention_decode"]
        for op, packed in ((alone, packed_alone), (beside, packed_mixed)):
            heads = 1 if packed else 2
            assert (op.blocks, op.streamed, op.split) == (2 * heads, 4 * 2 * heads * 40, float(packed))
            assert op.span == 20.0


def test_a_unified_call_prices_prefill_chunks_and_decodes_as_one_op():
    profile = dataclasses.replace(PROFILE, attention_unified=1.0, attention_prefill_overhead=0.5,
                                  attention_decode_overhead=0.25)  # fmt: skip
    step = StepShape(np.array([300.0]), np.array([50.0]), np.array([10.0, 30.0]), 3)
    (op,) = CostModel(SHAPE, profile, "x", 1).attention_ops(step)
    apart = _ops(PROFILE, step)
    prefill, decode = apart["attention_prefill"], apart["attention_decode"]
    assert op.name == "attention_mixed" and op.call == "prefill"  # one call: one fixed cost
    assert op.flops == prefill.flops + decode.flops and op.bytes == prefill.bytes + decode.bytes
    assert op.blocks == prefill.blocks + decode.blocks and op.span == max(prefill.span, decode.span)
    assert op.streamed == prefill.streamed + decode.streamed and op.rows == 300.0 + 2.0
    # a step of one kind is priced as before
    only = StepShape(np.zeros(0), np.zeros(0), np.array([10.0, 30.0]), 2)
    assert CostModel(SHAPE, profile, "x", 1).attention_ops(only) == [apart["attention_decode"]]


def test_wave_blocks_take_waves_and_split_a_packed_decodes_keys():
    # 2 decodes of 1,000 keys, packed: 2 blocks; 64 run at once: each splits its keys 7.8125
    # ways (1,000 / 128 tiles), not 32: 15.625 blocks of 128 keys, one wave
    profile = dataclasses.replace(PROFILE, attention_gqa_packing=1.0, attention_wave_blocks=64.0,
                                  attention_key_time=1.0, memory_bandwidth=1e12)  # fmt: skip
    step = StepShape(np.zeros(0), np.zeros(0), np.array([1000.0, 1000.0]), 2)
    op = _ops(profile, step)["attention_decode"]
    assert CostModel(SHAPE, profile, "x", 1).op_time(op) == pytest.approx(128.0)
    # unpacked (no split), 4 blocks of 1,000 keys, 2 run at once: two waves of 1,000 keys
    unpacked = dataclasses.replace(profile, attention_gqa_packing=0.0, attention_wave_blocks=2.0)
    op = _ops(unpacked, step)["attention_decode"]
    assert CostModel(SHAPE, unpacked, "x", 1).op_time(op) == pytest.approx(2 * 1000.0)


def test_element_wise_bytes_beyond_l2_come_from_dram():
    from servelab.executor.cost_model import ELEMENTWISE

    profile = dataclasses.replace(PROFILE, kernel_efficiency={"rms_norm": 4.0},
                                  bandwidth_efficiency=0.5, l2_bytes=1000.0)  # fmt: skip
    model = CostModel(SHAPE, profile, "x", 1)
    # 800 bytes fit: at 4 x 100 B/s; 3,000 do not: 2,000 from DRAM at 50 B/s
    assert model.seconds(ELEMENTWISE, 0.0, 800.0, 0.0, 0.0, "", "rms_norm") == pytest.approx(2.0)
    assert model.seconds(ELEMENTWISE, 0.0, 3000.0, 0.0, 0.0, "", "rms_norm") == pytest.approx(40.0)
    off = CostModel(SHAPE, dataclasses.replace(profile, l2_bytes=0.0), "x", 1)
    assert off.seconds(ELEMENTWISE, 0.0, 3000.0, 0.0, 0.0, "", "rms_norm") == pytest.approx(7.5)
