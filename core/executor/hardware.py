"""Hardware profiles: what the simulated executor's cost model knows of a device.

A profile is one YAML file of the `hardware` config group (`conf/hardware/`),
or a mapping with the same fields. Peak figures come from datasheets or
measurements (each profile names its sources and its `basis`: `measured` when its
figures were fitted to measured times, `datasheet` otherwise); the efficiencies turn
peaks into achieved rates and are what `servelab-calibrate` fits, on a real machine
or to measured GPU operator times (`--from-vidur`).
Sizes accept `80GiB`-style strings; rates are plain numbers (bytes/s, FLOP/s).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from servelab.errors import ConfigError
from servelab.executor.sizing import parse_bytes

DEFAULT_PROFILE = "cpu-local"
# what a profile's figures rest on: fitted to measured times, or datasheet peaks x estimates
BASES = ("measured", "datasheet")

# the figures `servelab-calibrate` fits; the rest are peaks and links
FITTED = (
    "matmul_efficiency",
    "attention_efficiency",
    "bandwidth_efficiency",
    "matmul_half_rows",
    "attention_half_rows",
    "elementwise_efficiency",
    "elementwise_full_rows",
    "kernel_efficiency",
    "matmul_overhead",
    "attention_prefill_overhead",
    "attention_decode_overhead",
    "attention_stream_efficiency",
    "attention_key_time",
    "attention_block_overhead",
    "attention_wave_blocks",
    "attention_tile_time",
    "attention_empty_block_time",
    "interconnect_latency",
    "interconnect_half_bytes",
    "interconnect_latency_per_device",
    "interconnect_curve_exponent",
    "launch_overhead",
    "step_overhead",
    "seq_overhead",
)


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    memory: int  # bytes of device memory, per device
    peak_flops: dict[str, float]  # dense FLOP/s per device, by dtype name
    memory_bandwidth: float  # bytes/s, per device (peak)
    matmul_efficiency: float = 0.7  # achieved / peak FLOP/s of projections and the LM head
    attention_efficiency: float = 0.5  # achieved / peak FLOP/s of attention
    bandwidth_efficiency: float = 0.8  # achieved / peak memory bandwidth
    # efficiency curves: an op of this many rows reaches half its class's efficiency (0: off)
    matmul_half_rows: float = 0.0
    attention_half_rows: float = 0.0
    # element-wise kernels (norms, RoPE, activation, adds): achieved / peak bandwidth
    # (0: bandwidth_efficiency), and the rows below which they cost as many (0: off)
    elementwise_efficiency: float = 0.0
    elementwise_full_rows: float = 0.0
    kernel_efficiency: dict[str, float] = field(default_factory=dict)  # by element-wise op name
    l2_bytes: float = 0.0  # L2 cache: element-wise bytes beyond it come from DRAM (0: off)
    # the L2 traffic after which a kernel's input written earlier (a fused norm's residual)
    # is no longer in L2 and is read from DRAM (`cost_model.residual_rereads`; 0: off)
    l2_reuse_bytes: float = 0.0
    matmul_overhead: float = 0.0  # seconds each matmul costs besides its roofline
    # seconds each attention call costs besides its flops and bytes, per layer
    attention_prefill_overhead: float = 0.0
    attention_decode_overhead: float = 0.0
    # attention's kernel blocks (one query head of a tile of up to 128 query rows): the
    # bandwidth of the K/V they stream (achieved / peak), seconds per key the longest
    # streams, seconds per block (0: off)
    attention_stream_efficiency: float = 0.0
    attention_key_time: float = 0.0
    attention_block_overhead: float = 0.0
    # the attention kernel's blocks for decodes: 0, one per query head (FlashAttention 2
    # varlen); 1, one per KV head with its query heads packed in, in steps of one-query
    # decodes alone (vLLM's FlashAttention 2); 2, so in every step (FlashAttention 3).
    # Not fitted: the kernel measured (the fits of measured attention pick the best)
    attention_gqa_packing: float = 0.0
    # attention blocks the device runs at once (about its cores x the blocks each holds):
    # a call of more takes waves of them, and a packed decode call of fewer splits each
    # block's keys over more blocks up to this many (split-KV decoding); 0: off
    attention_wave_blocks: float = 0.0
    # 1: a step's prefill chunks and decodes are one attention call (vLLM's FlashAttention
    # backend: one varlen launch), priced as one op; 0: a call each
    attention_unified: float = 0.0
    # vLLM's FlashAttention 2 over a paged KV cache (its split-KV kernel), in calls with a
    # prefill chunk: a block is one query head of 64 query rows of one sequence (a decode:
    # its one row, computed as 64) and computes whole tiles of 128 keys; the grid gives
    # every sequence as many row blocks as the longest chunk, the ones past a sequence's
    # rows exiting at once. `attention_sms`: the blocks the device runs at once (its SMs,
    # one block each; a datasheet figure, not fitted; 0: off); `attention_tile_time` and
    # `attention_empty_block_time`: an SM's seconds per tile and per empty block (a block
    # with rows: `attention_block_overhead` x `attention_sms` more)
    attention_sms: float = 0.0
    attention_tile_time: float = 0.0
    attention_empty_block_time: float = 0.0
    interconnect_bandwidth: float = 0.0  # bytes/s per device and direction (all-reduce)
    interconnect_latency: float = 0.0  # seconds per collective
    interconnect_half_bytes: float = 0.0  # a message of this size reaches half the bandwidth
    # collectives: seconds per further device (a ring's steps), and the exponent of the size
    # curve, bandwidth x (b / (b + half_bytes)) ** exponent (1: the plain curve)
    interconnect_latency_per_device: float = 0.0
    interconnect_curve_exponent: float = 1.0
    host_link_bandwidth: float = 25e9  # bytes/s device <-> host (swap)
    launch_overhead: float = 0.0  # seconds per kernel launch
    step_overhead: float = 0.0  # seconds of host work per step
    seq_overhead: float = 0.0  # seconds of host work per scheduled sequence
    basis: str = "datasheet"  # one of BASES; recorded with every simulated run
    sources: dict[str, str] = field(default_factory=dict)

    def flops(self, dtype: str) -> float:
        """Peak dense FLOP/s for `dtype`; a ConfigError naming the known dtypes otherwise."""
        if dtype not in self.peak_flops:
            raise ConfigError(
                f"hardware profile {self.name!r} has no peak FLOP/s for dtype {dtype}; "
                f"known: {', '.join(self.peak_flops)}"
            )
        return float(self.peak_flops[dtype])

    def with_fitted(self, **values: float) -> HardwareProfile:
        return dataclasses.replace(self, **values)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def conf_group_dir(group: str) -> Path:
    """conf/<group>, found without importing servelab.conf (which imports Hydra)."""
    spec = importlib.util.find_spec("servelab.conf")
    return Path(next(iter(spec.submodule_search_locations))) / group


def conf_group_names(group: str) -> list[str]:
    """The choices of a config group: its YAML files' names."""
    return sorted(p.stem for p in conf_group_dir(group).glob("*.yaml"))


def profile_dir() -> Path:
    return conf_group_dir("hardware")


def conf_node(node: Any, group: str, what: str, fields: set[str]) -> Mapping:
    """An entry of config group `group` as a mapping, from a choice's name, a YAML path or
    a mapping; an unknown choice, a non-mapping or an unknown field is named (`what`: the
    entry's kind, for the message)."""
    if isinstance(node, (str, Path)):
        path = Path(node) if str(node).endswith((".yaml", ".yml")) else None
        path = path or conf_group_dir(group) / f"{node}.yaml"
        if not path.is_file():
            raise ConfigError(f"unknown {what} {str(node)!r}; known: "
                              f"{', '.join(conf_group_names(group))} (or a path to a .yaml file)")  # fmt: skip
        import yaml

        node = yaml.safe_load(path.read_text())
    if not isinstance(node, Mapping):
        raise ConfigError(f"a {what} is a name, a path or a mapping, got {node!r}")
    unknown = set(node) - fields
    if unknown:
        raise ConfigError(f"unknown {what} field(s) {sorted(unknown)}; "
                          f"accepted: {', '.join(sorted(fields))}")  # fmt: skip
    return node


def profile_names() -> list[str]:
    return conf_group_names("hardware")


def load_profile(node: Any) -> HardwareProfile:
    """A profile from a name (`h100-sxm`), a YAML path, a mapping, or None (`cpu-local`)."""
    if isinstance(node, HardwareProfile):
        return node
    if node is None:
        node = DEFAULT_PROFILE
    names = {f.name for f in dataclasses.fields(HardwareProfile)}
    values = dict(conf_node(node, "hardware", "hardware profile", names))
    missing = {"name", "memory", "peak_flops", "memory_bandwidth"} - set(values)
    if missing:
        raise ConfigError(f"hardware profile lacks {sorted(missing)}")
    values["memory"] = parse_bytes(values["memory"], "hardware memory")
    values["peak_flops"] = {str(k): float(v) for k, v in dict(values["peak_flops"]).items()}
    values["sources"] = {str(k): str(v) for k, v in dict(values.get("sources") or {}).items()}
    if values.setdefault("basis", "datasheet") not in BASES:
        raise ConfigError(
            f"hardware profile basis must be one of {', '.join(BASES)}, got {values['basis']!r}"
        )
    if values.get("attention_gqa_packing", 0) not in (0, 1, 2):
        raise ConfigError(f"hardware profile attention_gqa_packing must be 0, 1 or 2, got "
                          f"{values['attention_gqa_packing']!r}")  # fmt: skip
    kernels = dict(values.get("kernel_efficiency") or {})
    values["kernel_efficiency"] = {str(k): float(v) for k, v in kernels.items()}
    for key in names - {"name", "memory", "peak_flops", "sources", "kernel_efficiency", "basis"}:
        if key in values:
            values[key] = float(values[key])
            if values[key] < 0:
                raise ConfigError(f"hardware profile {key} must be >= 0, got {values[key]}")
    return HardwareProfile(**values)
