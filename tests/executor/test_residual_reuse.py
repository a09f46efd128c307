"""A fused norm's residual read again from DRAM once L2 traffic evicted it
(`l2_reuse_bytes`): hand-computed prices, both forms (`CostModel`, `op_times`) equal,
and off by default."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from servelab.executor.cost_model import (
    ELEMENTWISE,
    CostModel,
    Op,
    Shape,
    evicted,
    residual_rereads,
)
from servelab.executor.hardware import HardwareProfile
from servelab.lab.op_times import op_times

# h = 8, 2 query heads and 1 KV head of 4, intermediate 8; 1 byte per element
SHAPE = Shape(hidden_size=8, intermediate_size=8, num_layers=1, num_heads=2, num_kv_heads=1,
              head_dim=4, vocab_size=10)  # fmt: skip
# DRAM at 0.5 x 100 B/s = 50 B/s; an L2 keeping 1,000 bytes
PROFILE = HardwareProfile("toy", 1, {"x": 1e30}, 100.0, bandwidth_efficiency=0.5,
                          l2_reuse_bytes=1000.0)  # fmt: skip


def test_lru_evicts_the_oldest_bytes_first():
    # 100 stale bytes, then 950 more: 1,050 > 1,000, the oldest 50 are gone
    assert evicted(100.0, 950.0, 1000.0) == 50.0
    assert evicted(100.0, 800.0, 1000.0) == 0.0  # 900 bytes in all: L2 holds them
    assert evicted(100.0, 5000.0, 1000.0) == 100.0  # at most the stale bytes


def test_the_rereads_traffic_by_hand():
    # 3 tokens; attention block: qkv weights 8 x 16 + o weights 8 x 8 = 192, a token's
    # activations: norm 8, qkv 16, K/V cache 8, attention 8, o 8 = 48 -> 192 + 144
    # MLP block: gate_up + down weights 3 x 8 x 8 = 192, a token's: 8 + 16 + 8 + 8 = 40
    attention, mlp = residual_rereads(SHAPE, 1, 3.0, 1.0)
    assert attention.behind == 336.0 and mlp.behind == 192.0 + 120.0
    assert attention.stale == mlp.stale == 24.0  # the residual: 3 tokens x 8
    half = residual_rereads(SHAPE, 1, 3.0, 1.0, share=0.5, which=("attention",))
    assert len(half) == 1 and half[0].stale == 12.0
    assert attention.bytes == 0.0 and attention.launches == 0.0


def test_an_evicted_residual_costs_its_dram_read_in_both_forms():
    op = Op("residual_reread", ELEMENTWISE, 0.0, 0.0, launches=0.0, rows=3.0, stale=100.0,
            behind=950.0)  # fmt: skip
    # 50 bytes evicted, read at 50 B/s: 1 s
    assert CostModel(SHAPE, PROFILE, "x", 1).op_time(op) == pytest.approx(1.0)
    vector = op_times(PROFILE, "x", np.array([ELEMENTWISE]), np.zeros(1), np.zeros(1),
                      np.array([3.0]), np.zeros(1), np.array([""]), np.array([op.name]),
                      stale=np.array([op.stale]), behind=np.array([op.behind]))  # fmt: skip
    assert vector[0] == pytest.approx(1.0)
    off = dataclasses.replace(PROFILE, l2_reuse_bytes=0.0)
    assert CostModel(SHAPE, off, "x", 1).op_time(op) == 0.0


def test_off_the_layer_is_unchanged():
    off = dataclasses.replace(PROFILE, l2_reuse_bytes=0.0)
    names = [op.name for op in CostModel(SHAPE, off, "x", 1).layer_elementwise_ops(3.0)]
    assert names == ["rms_norm", "residual_add", "rope", "activation"]
    on = CostModel(SHAPE, PROFILE, "x", 1).layer_elementwise_ops(3.0)
    assert [op.name for op in on[4:]] == ["residual_reread", "residual_reread"]
