"""The CPU profile prices every step as it did before the GPU profiles were refitted
to measured collectives and attention: the figures those fits added default to values
that leave the formulas as they were, and cpu-local sets none of them. The expected
times were computed by the cost model and conf/hardware/cpu-local.yaml of commit
78e3848 (before those figures existed), not by the code under test."""

from __future__ import annotations

import numpy as np

from servelab.executor.cost_model import CostModel, Shape, StepShape
from servelab.executor.hardware import HardwareProfile, load_profile

SHAPE = Shape(hidden_size=512, intermediate_size=1536, num_layers=8, num_heads=8,
              num_kv_heads=4, head_dim=64, vocab_size=32000)  # fmt: skip
STEPS = [
    StepShape(np.array([128.0]), np.array([0.0]), np.zeros(0), 1),
    StepShape(np.array([64.0]), np.array([256.0]), np.array([17.0, 300.0, 5.0]), 4),
    StepShape(np.zeros(0), np.zeros(0), np.arange(1.0, 33.0), 32),
    StepShape(np.array([96.0, 7.0]), np.array([0.0, 40.0]), np.array([3.0]), 3, padded=True),
]
# tensor-parallel degree -> each step's seconds, and a copy of 4 KiB swapped + 8 KiB copied
BEFORE = {
    1: ([0.10343570475712434, 0.06885489907194063, 0.053522386112619384, 0.09480759812832978],
        6.275234251878843e-06),
    2: ([0.05367876298020189, 0.035710389370905406, 0.028541819542121583, 0.04912279651062356],
        5.137617125939421e-06),
}  # fmt: skip


def test_cpu_local_prices_every_step_exactly_as_before():
    profile = load_profile("cpu-local")
    for tp, (steps, copy) in BEFORE.items():
        model = CostModel(SHAPE, profile, "float32", 4, tp)
        assert [model.step_time(s) for s in STEPS] == steps
        assert model.copy_time(4096.0, 8192.0) == copy


def test_cpu_local_sets_none_of_the_measured_gpu_figures():
    profile = load_profile("cpu-local")
    defaults = HardwareProfile("defaults", 1, {}, 1.0)
    for name in ("interconnect_latency_per_device", "interconnect_curve_exponent",
                 "interconnect_half_bytes", "attention_half_rows", "attention_prefill_overhead",
                 "attention_decode_overhead", "kernel_efficiency", "matmul_overhead",
                 "attention_stream_efficiency", "attention_key_time",
                 "attention_block_overhead", "attention_gqa_packing", "attention_wave_blocks",
                 "attention_unified", "attention_sms", "attention_tile_time",
                 "attention_empty_block_time", "l2_bytes"):  # fmt: skip
        assert getattr(profile, name) == getattr(defaults, name), name
