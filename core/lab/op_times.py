"""`op_times`: the cost model's per-operator time (`CostModel.op_time`) over
arrays of operators at once, for the least-squares fits of `calibrate` and
`calibrate_vidur`, which price thousands of ops per trial profile
(`tests/lab/test_vidur_data.py` holds it equal to `CostModel.op_time`)."""

from __future__ import annotations

import numpy as np

from servelab.executor.cost_model import (
    ATTENTION,
    DECODE,
    ELEMENTWISE,
    MATMUL,
    PREFILL,
    split_blocks,
)
from servelab.executor.hardware import HardwareProfile


def op_times(profile: HardwareProfile, dtype: str, kind: np.ndarray, flops: np.ndarray,
             data: np.ndarray, rows: np.ndarray, launches: np.ndarray,
             call: np.ndarray, names: np.ndarray, streamed: np.ndarray | None = None,
             span: np.ndarray | None = None, blocks: np.ndarray | None = None,
             split: np.ndarray | None = None) -> np.ndarray:  # fmt: skip
    """`CostModel.op_time` over arrays of ops (a test holds the two equal); attention's
    kernel blocks (`streamed`, `span`, `blocks`) where given."""
    peak = profile.flops(dtype)
    rate = np.full_like(flops, np.inf)
    half = np.zeros_like(flops)
    for k, eff, h in ((MATMUL, profile.matmul_efficiency, profile.matmul_half_rows),
                      (ATTENTION, profile.attention_efficiency, profile.attention_half_rows)):  # fmt: skip
        mask = kind == k
        rate[mask], half[mask] = peak * eff, h
    curve = np.ones_like(rows, dtype=np.float64)  # rows may come as integers
    curved = (half > 0) & (rows > 0)
    curve[curved] = rows[curved] / (rows[curved] + half[curved])
    compute = np.divide(flops, rate * curve, out=np.zeros_like(flops), where=flops > 0)
    bandwidth = np.full_like(data, profile.memory_bandwidth * profile.bandwidth_efficiency)
    elementwise = kind == ELEMENTWISE
    efficiency = profile.elementwise_efficiency or profile.bandwidth_efficiency
    bandwidth[elementwise] = profile.memory_bandwidth * efficiency
    for kernel, eff in profile.kernel_efficiency.items():
        bandwidth[elementwise & (names == kernel)] = profile.memory_bandwidth * eff
    full = profile.elementwise_full_rows
    wave = np.ones_like(data)
    waved = elementwise & (rows > 0) & (full > 0)
    wave[waved] = np.maximum(rows[waved], full) / rows[waved]
    fixed = launches * profile.launch_overhead
    fixed = fixed + np.where(call == MATMUL, profile.matmul_overhead, 0.0)
    fixed = fixed + np.where(call == PREFILL, profile.attention_prefill_overhead, 0.0)
    fixed = fixed + np.where(call == DECODE, profile.attention_decode_overhead, 0.0)
    memory = data * wave / bandwidth
    if profile.l2_bytes:  # element-wise bytes beyond L2 come from DRAM
        dram = np.maximum(data - profile.l2_bytes, 0.0) / (
            profile.memory_bandwidth * profile.bandwidth_efficiency
        )
        memory = np.where(elementwise, np.maximum(memory, dram), memory)
    seconds = np.maximum(compute, memory) + fixed
    stream = profile.memory_bandwidth * profile.attention_stream_efficiency
    if blocks is not None and (stream or profile.attention_key_time
                               or profile.attention_block_overhead):  # fmt: skip
        span, blocks, waves = split_blocks(span, blocks, split if split is not None else 0.0,
                                           profile.attention_wave_blocks)  # fmt: skip
        held = np.maximum(streamed / stream if stream else 0.0,
                          span * profile.attention_key_time * waves)  # fmt: skip
        held = np.maximum(held, blocks * profile.attention_block_overhead)
        seconds = np.where(blocks > 0, np.maximum(seconds, held + fixed), seconds)
    return seconds
