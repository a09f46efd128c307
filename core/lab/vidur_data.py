"""Vidur's measured GPU operator times, as rows of servelab's cost terms.

Vidur (github.com/microsoft/vidur, MIT licence) publishes per-operator times measured
on A100 and H100 GPUs as CSV files under its `data/profiling/`:
`compute/<device>/<org>/<model>/mlp.csv` (linear layers and element-wise kernels of one
decoder layer, per token count and tensor-parallel degree), `.../attention.csv`
(prefill chunks and decode batches) and `network/<node>/all_reduce.csv` (NCCL
all-reduce by message size and device count). Each row becomes the op servelab's
cost model runs for it (built by the cost model's own formulas, so a fit here is a
fit of the simulator) beside the measured median seconds. Nothing is downloaded:
the reader takes a local copy of that folder. Rows of models without a gated MLP
(phi-2: GELU, a three-way add) are skipped: servelab's decoders are gated.
"""

from __future__ import annotations

import csv
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from servelab.errors import ConfigError
from servelab.executor.cost_model import (
    ELEMENTWISE,
    CostModel,
    Op,
    Shape,
    StepShape,
    matmul_op,
)
from servelab.executor.hardware import HardwareProfile

BYTES = 2  # Vidur profiles in float16
DTYPE = "float16"
MS = 1e-3
OP_FIELDS = tuple(f.name for f in dataclasses.fields(Op))  # a column each in `MeasuredOps`
# mlp.csv's timed kernels, by their Vidur name -> servelab's op
LINEAR = {
    "attn_pre_proj": "qkv_proj",
    "attn_post_proj": "o_proj",
    "mlp_up_proj": "gate_up_proj",
    "mlp_down_proj": "down_proj",
}
ELEMENTWISE_OPS = {
    "input_layernorm": "rms_norm",
    "post_attention_layernorm": "rms_norm",
    "attn_rope": "rope",
    "mlp_act": "activation",
    "add": "residual_add",
}


@dataclass
class MeasuredOps:
    """Measured ops as flat arrays (one entry per op and row): what they are, the cost
    model's op for them, and their measured median seconds. A measurement may be several
    of the cost model's ops (a fused kernel, one attention call over prefill chunks and
    decodes): they share a `group`, each carries the measurement's seconds, and the
    measurement is priced as their sum (`calibrate_vidur.OpArrays`); `label` names what
    was measured (by default the op's call)."""

    columns: dict[str, list] = field(
        default_factory=lambda: {
            k: [] for k in ("model", "tp", "tokens", *OP_FIELDS, "seconds", "file", "group", "label")
        }
    )

    def add(self, op: Op, model: str, tp: int, tokens: float, seconds: float, file: str,
            group: int | None = None, label: str | None = None) -> None:  # fmt: skip
        """One op measured alone, or (`group`) one part of a measurement of several."""
        group = self.groups() if group is None else group
        values = dict(model=model, tp=tp, tokens=tokens, **{k: getattr(op, k) for k in OP_FIELDS},
                      seconds=seconds, file=file, group=group,
                      label=op.call if label is None else label)  # fmt: skip
        for key, value in values.items():
            self.columns[key].append(value)

    def add_group(self, ops: list[Op], model: str, tp: int, tokens: float, seconds: float,
                  file: str, label: str | None = None) -> None:  # fmt: skip
        """One measurement of several ops, priced as their sum."""
        group = self.groups()
        for op in ops:
            self.add(op, model, tp, tokens, seconds, file, group, label)

    def groups(self) -> int:
        """How many measurements (groups are numbered 0, 1, ... as they are added)."""
        group = self.columns["group"]
        return group[-1] + 1 if group else 0

    def array(self, key: str) -> np.ndarray:
        values = self.columns[key]
        numeric = key not in ("model", "name", "kind", "call", "file", "label")
        return np.asarray(values, dtype=np.float64 if numeric else object).astype(
            np.float64 if numeric else str
        )

    def __len__(self) -> int:
        """The measurements (an op measured alone is one)."""
        return self.groups()

    def select(self, mask: np.ndarray) -> MeasuredOps:
        """The ops where `mask` holds, their groups renumbered (a mask by model, TP or
        file keeps or drops a measurement's ops together)."""
        out = MeasuredOps()
        index = np.flatnonzero(mask)
        for key, values in self.columns.items():
            out.columns[key] = [values[i] for i in index]
        kept = out.columns["group"]
        renumber = {g: i for i, g in enumerate(dict.fromkeys(kept))}
        out.columns["group"] = [renumber[g] for g in kept]
        return out


@dataclass
class MeasuredCollectives:
    """Collective measurements: message bytes, devices, seconds. `passes` is how many
    times each device moves (p - 1) / p of the message: 2 for an all-reduce (reduce-scatter,
    then all-gather), 1 for an all-gather or a reduce-scatter."""

    bytes: np.ndarray
    devices: np.ndarray
    seconds: np.ndarray
    files: list[str]
    passes: int = 2
    collective: str = "all_reduce"

    def select(self, mask: np.ndarray) -> MeasuredCollectives:
        return MeasuredCollectives(self.bytes[mask], self.devices[mask], self.seconds[mask],
                                   self.files, self.passes, self.collective)  # fmt: skip


def _median(row: dict, op: str) -> float | None:
    value = row.get(f"time_stats.{op}.median", "")
    return float(value) * MS if value not in ("", None) and float(value) > 0 else None


def _shape(row: dict, heads_key: str) -> Shape:
    h, heads = int(row["n_embd"]), int(row[heads_key])
    return Shape(hidden_size=h, intermediate_size=int(row.get("n_expanded_embd") or 0),
                 num_layers=1, num_heads=heads, num_kv_heads=int(row["n_kv_head"]),
                 head_dim=h // heads, vocab_size=int(row.get("vocab_size") or 1))  # fmt: skip


def linear_and_elementwise_ops(shape: Shape, tp: int, tokens: float) -> dict[str, Op]:
    """The ops of one row of mlp.csv, by Vidur's kernel name: each a single launch."""
    t, e, c = tokens, BYTES, shape
    d, heads, kv = c.head_dim, c.num_heads / tp, c.num_kv_heads / tp
    h, inter = c.hidden_size, c.intermediate_size / tp
    ops = {
        "attn_pre_proj": matmul_op("qkv_proj", t, h, (heads + 2 * kv) * d, e),
        "attn_post_proj": matmul_op("o_proj", t, heads * d, h, e),
        "mlp_up_proj": matmul_op("gate_up_proj", t, h, 2 * inter, e),
        "mlp_down_proj": matmul_op("down_proj", t, inter, h, e),
        "attn_rope": Op("rope", ELEMENTWISE, 0.0, e * t * 2 * (heads + kv) * d, rows=t),
        "mlp_act": Op("activation", ELEMENTWISE, 0.0, e * t * 3 * inter, rows=t),
        "add": Op("residual_add", ELEMENTWISE, 0.0, e * t * 3 * h, rows=t),
    }
    norm = Op("rms_norm", ELEMENTWISE, 0.0, e * t * 2 * h, rows=t)
    ops["input_layernorm"] = ops["post_attention_layernorm"] = norm
    return ops


def read_mlp(path: Path, measured: MeasuredOps, model: str) -> int:
    """Adds one mlp.csv's rows; the number of measurements kept."""
    kept = 0
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            if str(row.get("use_gated_mlp", "True")).lower() != "true":
                continue
            tp, tokens = int(row["num_tensor_parallel_workers"]), float(row["num_tokens"])
            for vidur, op in linear_and_elementwise_ops(_shape(row, "n_head"), tp, tokens).items():
                seconds = _median(row, vidur)
                if seconds is not None:
                    measured.add(op, model, tp, tokens, seconds, str(path))
                    kept += 1
    return kept


def read_attention(path: Path, measured: MeasuredOps, model: str, kv_total: bool = False,
                   kernel: HardwareProfile | None = None) -> int:  # fmt: skip
    """Adds one attention.csv's rows (prefill chunks of batch 1, decode batches).
    `kv_cache_size` is Vidur's: the keys cached before a prefill chunk, each decode's
    keys; with `kv_total` it is LLMServingSim's: a chunk's whole context (itself
    included), a decode batch's keys in all, split evenly (rows of fewer keys than
    sequences are skipped: they time empty sequences). `kernel`: a profile whose
    attention figures build the kernel's calls (None: the defaults)."""
    kept = 0
    profile = kernel or HardwareProfile("shape-only", 1, {DTYPE: 1.0}, 1.0)
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            shape, tp = _shape(row, "n_q_head"), int(row["num_tensor_parallel_workers"])
            batch, cached = int(row["batch_size"]), float(row["kv_cache_size"])
            prefill = str(row["is_prefill"]).lower() == "true"
            if kv_total and prefill:
                cached -= float(row["prefill_chunk_size"])
            elif kv_total:
                if cached < batch:
                    continue
                cached = float(int(cached) // batch)
            if prefill:
                chunk = float(row["prefill_chunk_size"])
                step = StepShape(np.array([chunk]), np.array([cached]), np.zeros(0), 1)
                seconds, tokens = _median(row, "attn_prefill"), chunk
            else:
                step = StepShape(np.zeros(0), np.zeros(0), np.full(batch, cached), batch)
                seconds, tokens = _median(row, "attn_decode"), float(batch)
            if seconds is None:
                continue
            (op,) = CostModel(shape, profile, DTYPE, BYTES, tp).attention_ops(step)
            measured.add(op, model, tp, tokens, seconds, str(path))
            kept += 1
    return kept


def read_all_reduce(path: Path) -> MeasuredCollectives:
    """All-reduce rows within one node (devices == devices_per_node). `size` is the
    message in bytes: Vidur's own predictor maps a step of T tokens to the row of
    size = 2 T h ("each token is of size 2 * h bytes"), and the times agree with bytes,
    not float16 elements (read as elements, the largest two-GPU rows would move 548 GB/s
    per direction, beyond NVLink 4's 450; read as bytes they match APEX's NCCL
    measurements of the same sizes within a few per cent)."""
    sizes, devices, seconds = [], [], []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            if row.get("collective", "all_reduce") != "all_reduce":
                continue
            p = int(row["num_workers"])
            if p != int(row.get("devices_per_node") or p) or _median(row, "all_reduce") is None:
                continue
            sizes.append(float(row["size"]))
            devices.append(p)
            seconds.append(_median(row, "all_reduce"))
    return MeasuredCollectives(np.array(sizes), np.array(devices, dtype=np.float64),
                               np.array(seconds), [str(path)])  # fmt: skip


def device_folder(base: Path, name: str, what: str, expected: str) -> Path:
    """`base / name`, a device's folder of a measured data set; when absent, an error
    naming what was expected there and the devices `base` has."""
    folder = base / name
    if not folder.is_dir():
        found = sorted(p.name for p in base.glob("*") if p.is_dir()) if base.is_dir() else []
        raise ConfigError(
            f"no {what} at {folder} (expected {expected}); devices there: "
            f"{', '.join(found) or 'none'}"
        )
    return folder


def read_vidur(
    root: Path, device: str, network: str | None
) -> tuple[MeasuredOps, MeasuredCollectives | None]:
    """Every model's mlp.csv and attention.csv under `root/compute/<device>/`, and
    `root/network/<network>/all_reduce.csv` (when `network` is given)."""
    root = Path(root)
    compute = device_folder(
        root / "compute", device, "Vidur compute profiles",
        "<dir>/compute/<device>/<org>/<model>/mlp.csv, e.g. vidur's data/profiling",
    )  # fmt: skip
    measured = MeasuredOps()
    for path in sorted(compute.rglob("mlp.csv")):
        read_mlp(path, measured, str(path.parent.relative_to(compute)))
    for path in sorted(compute.rglob("attention.csv")):
        read_attention(path, measured, str(path.parent.relative_to(compute)))
    if not len(measured):
        raise ConfigError(f"no mlp.csv or attention.csv rows under {compute}")
    collectives = None
    if network:
        path = root / "network" / network / "all_reduce.csv"
        if not path.is_file():
            nodes = sorted(p.name for p in (root / "network").glob("*"))
            raise ConfigError(
                f"no all_reduce.csv at {path}; network profiles there: {', '.join(nodes) or 'none'}"
            )
        collectives = read_all_reduce(path)
    return measured, collectives
