"""`op_times`: the cost model's per-operator time (`CostModel.op_time`) over
arrays of operators at once, for the least-squares fits of `calibrate` and
`calibrate_vidur`, which price thousands of ops per trial profile
(`tests/lab/test_vidur_data.py` holds it equal to `CostModel.op_time`)."""

from __future__ import annotations

import numpy as np

from servelab.executor.cost_model import (
    ATTENTION,
    BLOCK_ROWS,
    DECODE,
    ELEMENTWISE,
    MATMUL,
    PREFILL,
    evicted,
    split_blocks,
)
from servelab.executor.hardware import HardwareProfile

TILE_KEYS = ("tiles", "tile_blocks", "empty", "reread", "reuse")  # `Op`'s paged-kernel fields


def op_times(profile: HardwareProfile, dtype: str, kind: np.ndarray, flops: np.ndarray,
             data: np.ndarray, rows: np.ndarray, launches: np.ndarray,
             call: np.ndarray, names: np.ndarray, streamed: np.ndarray | None = None,
             span: np.ndarray | None = None, blocks: np.ndarray | None = None,
             split: np.ndarray | None = None,
             paged: dict[str, np.ndarray] | None = None, stale: np.ndarray | None = None,
             behind: np.ndarray | None = None) -> np.ndarray:  # fmt: skip
    """`CostModel.op_time` over arrays of ops (a test holds the two equal); attention's
    kernel blocks (`streamed`, `span`, `blocks`) where given, `paged`, the paged
    kernel's (`TILE_KEYS`), and `stale` / `behind`, inputs L2 may no longer hold."""
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
    dram_rate = profile.memory_bandwidth * profile.bandwidth_efficiency  # DRAM, as achieved
    bandwidth = np.full_like(data, dram_rate)
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
        dram = np.maximum(data - profile.l2_bytes, 0.0) / dram_rate
        memory = np.where(elementwise, np.maximum(memory, dram), memory)
    seconds = np.maximum(compute, memory) + fixed
    held = seconds
    stream = profile.memory_bandwidth * profile.attention_stream_efficiency
    if blocks is not None and (stream or profile.attention_key_time
                               or profile.attention_block_overhead):  # fmt: skip
        spans, split_into, waves = split_blocks(span, blocks, split if split is not None else 0.0,
                                                profile.attention_wave_blocks)  # fmt: skip
        streaming = np.maximum(streamed / stream if stream else 0.0,
                               spans * profile.attention_key_time * waves)  # fmt: skip
        streaming = np.maximum(streaming, split_into * profile.attention_block_overhead)
        held = np.where(blocks > 0, np.maximum(seconds, streaming + fixed), seconds)
    if profile.attention_sms and paged is not None:  # `CostModel.held_to_tiles`
        tiled = paged["tiles"] > 0
        held[tiled] = _held_to_tiles(profile, seconds[tiled], data[tiled], span[tiled],
                                     fixed[tiled], {k: v[tiled] for k, v in paged.items()},
                                     dram_rate)  # fmt: skip
    if profile.l2_reuse_bytes and stale is not None and behind is not None:
        dram = evicted(stale, behind, profile.l2_reuse_bytes)  # `CostModel.op_time`
        held = held + np.where(stale > 0, dram / dram_rate, 0.0)
    return held


def _held_to_tiles(profile: HardwareProfile, seconds, data, span, fixed, paged,
                   dram_rate: float) -> np.ndarray:  # fmt: skip
    """`CostModel.held_to_tiles` over arrays."""
    sms, tile = profile.attention_sms, profile.attention_tile_time
    block = profile.attention_block_overhead * sms
    blocks = paged["tile_blocks"]
    work = paged["tiles"] * tile + blocks * block
    longest = np.ceil(span / BLOCK_ROWS) * tile + block
    compute = np.maximum(np.ceil(blocks / sms) * work / blocks, longest)
    dram = (data + paged["reread"] * np.minimum(1.0, paged["reuse"] / sms)) / dram_rate
    empty = paged["empty"] * profile.attention_empty_block_time / sms
    return np.maximum(seconds, np.maximum(compute, dram) + empty + fixed)
