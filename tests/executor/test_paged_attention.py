"""vLLM's paged FlashAttention 2 in calls with a prefill chunk (`attention_sms`,
`attention_tile_time`, `attention_empty_block_time`): its blocks counted by hand, their
price by hand, and off by default."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from servelab.executor.cost_model import CostModel, Shape, StepShape, paged_blocks
from servelab.executor.hardware import HardwareProfile

# d = 4, 2 query heads, 1 KV head; 1 byte per element
SHAPE = Shape(hidden_size=8, intermediate_size=8, num_layers=1, num_heads=2, num_kv_heads=1,
              head_dim=4, vocab_size=10)  # fmt: skip
# one call for chunks and decodes; decodes alone packed (so not in a call with a chunk)
PROFILE = HardwareProfile("toy", 1, {"x": 1e30}, 1e4, bandwidth_efficiency=1.0,
                          attention_unified=1.0, attention_gqa_packing=1.0)  # fmt: skip
TILED = dataclasses.replace(PROFILE, attention_sms=4.0, attention_tile_time=1.0,
                            attention_block_overhead=0.25, attention_empty_block_time=2.0)  # fmt: skip
# a chunk of 100 tokens after 50 cached beside decodes over 129 and 10 keys
STEP = StepShape(np.array([100.0]), np.array([50.0]), np.array([129.0, 10.0]), 3)


def _mixed(profile):
    model = CostModel(SHAPE, profile, "x", 1)
    (op,) = model.attention_ops(STEP)
    return model, op


def test_blocks_are_64_rows_of_whole_128_key_tiles_in_a_grid_padded_to_the_longest_chunk():
    paged = paged_blocks(STEP.prefill_q, STEP.prefill_start, STEP.decode_keys, 2, 2)
    # the chunk's row blocks end at rows 64 and 100: keys 114 and 150, 1 + 2 tiles; the
    # decodes 2 + 1 tiles; each for 2 query heads
    assert paged["tiles"] == 2 * 3 + 2 * 3
    assert paged["tile_blocks"] == 2 * 2 + 2 * 2 and paged["reuse"] == 4
    # grid: 2 row blocks x 3 sequences x 2 heads; each decode's second row block is empty
    assert paged["empty"] == 12 - 8


def test_a_call_costs_its_waves_of_blocks_its_dram_bytes_and_its_empty_blocks():
    model, op = _mixed(TILED)
    # 8 blocks of 12 tiles and 8 x 0.25 x 4 SM-seconds of overhead: 2 waves of the mean
    # block (20 / 8), longer than the longest (2 tiles + 1); 4 empty blocks at 2 / 4 each
    assert op.reread == 4 * 2 * (2 - 1) * 139  # the second query head's K/V of the decodes
    assert model.op_time(op) == pytest.approx(2 * 20 / 8 + 4 * 2 / 4)
    # DRAM-bound at 100 B/s: every byte once, and the decodes' K/V again for the second
    # query head, whose blocks fall in another wave: reuse (4 blocks a head) / 4 SMs of them
    slow = dataclasses.replace(TILED, memory_bandwidth=100.0)
    assert CostModel(SHAPE, slow, "x", 1).op_time(op) == pytest.approx((op.bytes + op.reread) / 100 + 2)
    # on 8 SMs half of them share the first head's reads through L2
    wide = dataclasses.replace(slow, attention_sms=8.0)
    assert CostModel(SHAPE, wide, "x", 1).op_time(op) == pytest.approx((op.bytes + op.reread / 2) / 100 + 1)


def test_off_without_attention_sms():
    plain, op = _mixed(PROFILE)
    unused = dataclasses.replace(TILED, attention_sms=0.0, attention_block_overhead=0.0)
    assert CostModel(SHAPE, unused, "x", 1).op_time(op) == plain.op_time(op) == pytest.approx(op.bytes / 1e4)


def test_the_vector_form_prices_a_paged_call_alike():
    """`op_times` (the fit's form over arrays) and `CostModel.op_time` agree on paged calls,
    in both the compute- and the DRAM-bound regime."""
    from servelab.lab.op_times import TILE_KEYS, op_times

    for profile in (TILED, dataclasses.replace(TILED, memory_bandwidth=100.0)):
        model, op = _mixed(profile)
        columns = ("kind", "flops", "bytes", "rows", "launches", "call", "name", "streamed",
                   "span", "blocks", "split")  # fmt: skip
        vector = op_times(profile, "x", *(np.array([getattr(op, k)]) for k in columns),
                          {k: np.array([getattr(op, k)], dtype=float) for k in TILE_KEYS})  # fmt: skip
        assert vector[0] == pytest.approx(model.op_time(op), rel=1e-12)
