"""`servelab-calibrate --from-vidur DIR`: fit a GPU hardware profile to measured
operator times (Vidur's profiling CSVs, read by `vidur_data`).

Each measured op is priced by the cost model's own formula (`op_times.op_times`,
the vectorised `CostModel.op_time`) and the profile's figures are fitted by least
squares on the log of predicted / measured (a robust soft-L1 loss: a few outlier
kernels must not drag the rest), the peaks held fixed. Which figures are fitted
depends on the rows present: matmul and element-wise figures from mlp.csv,
attention figures from attention.csv, the collective's latency floor, bandwidth
and size curve from all_reduce.csv. `errors_by_band` is the per-operator error
table the accuracy benchmark and the profile's `sources` report.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from servelab.executor.cost_model import ATTENTION, ELEMENTWISE, MATMUL
from servelab.executor.hardware import HardwareProfile
from servelab.lab.op_times import TILE_KEYS, op_times
from servelab.lab.vidur_data import DTYPE, OP_FIELDS, MeasuredCollectives, MeasuredOps

# figure -> (lower bound, upper bound, scale, the op kind whose rows fit it)
FIGURES = {
    "matmul_efficiency": (1e-3, 1.0, 1.0, MATMUL),
    "matmul_half_rows": (0.0, 1e4, 100.0, MATMUL),
    "bandwidth_efficiency": (1e-3, 1.0, 1.0, MATMUL),
    "matmul_overhead": (0.0, 1e-3, 1e-6, MATMUL),
    "elementwise_full_rows": (0.0, 1e5, 100.0, ELEMENTWISE),
    "launch_overhead": (0.0, 1e-3, 1e-6, ELEMENTWISE),
    "l2_bytes": (1e5, 1e10, 1e7, ELEMENTWISE),
    "l2_reuse_bytes": (1e6, 1e10, 1e8, ELEMENTWISE),
    "attention_efficiency": (1e-3, 1.0, 1.0, ATTENTION),
    "attention_half_rows": (0.0, 1e4, 100.0, ATTENTION),
    "attention_prefill_overhead": (0.0, 1e-3, 1e-6, ATTENTION),
    "attention_decode_overhead": (0.0, 1e-3, 1e-6, ATTENTION),
    "attention_stream_efficiency": (1e-3, 5.0, 1.0, ATTENTION),
    "attention_key_time": (0.0, 1e-6, 1e-8, ATTENTION),
    "attention_block_overhead": (0.0, 1e-6, 1e-8, ATTENTION),
    "attention_wave_blocks": (0.0, 1e5, 100.0, ATTENTION),
    "attention_tile_time": (0.0, 1e-3, 1e-6, ATTENTION),
    "attention_empty_block_time": (0.0, 1e-4, 1e-7, ATTENTION),
}
# the paged kernel's figures: fitted only where the profile names its SMs (`attention_sms`)
TILED = ("attention_tile_time", "attention_empty_block_time")
# element-wise kernels' efficiency: achieved / peak DRAM bandwidth; above 1 where the
# data sits in L2 (a kernel reading what the one before it wrote)
KERNEL_BOUNDS = (1e-3, 10.0)  # L2 reads (and a fused kernel's bytes priced as two ops')
COLLECTIVE = {
    "interconnect_latency": (0.0, 1e-2, 1e-5),
    "interconnect_latency_per_device": (0.0, 1e-3, 1e-6),
    "interconnect_bandwidth": (1e8, 1e13, 1e11),
    "interconnect_half_bytes": (0.0, 1e9, 1e5),
    "interconnect_curve_exponent": (0.05, 3.0, 1.0),
}
BANDS = ((1, 64), (65, 256), (257, 1023), (1024, float("inf")))  # tokens (or decode batch)




class OpArrays:
    """A `MeasuredOps` as the arrays `op_times` reads (`op`: one entry per op), and one
    entry per measurement: `seconds`, `tokens`, `tp`, `model`, `kind` (its first op's),
    `call` (its label: prefill, decode, mixed...). `predict` prices each measurement as
    the sum of its ops."""

    def __init__(self, ops: MeasuredOps) -> None:
        self.op = {key: ops.array(key) for key in OP_FIELDS}
        self.group = np.asarray(ops.columns["group"], dtype=np.int64)
        first = np.unique(self.group, return_index=True)[1]
        self.kind, self.name = self.op["kind"][first], self.op["name"][first]
        self.call = ops.array("label")[first]
        for key in ("seconds", "tokens", "tp", "model"):
            setattr(self, key, ops.array(key)[first])

    def predict(self, profile: HardwareProfile) -> np.ndarray:
        o = self.op
        times = op_times(profile, DTYPE, o["kind"], o["flops"], o["bytes"], o["rows"],
                         o["launches"], o["call"], o["name"], o["streamed"], o["span"],
                         o["blocks"], o["split"], {k: o[k] for k in TILE_KEYS},
                         o["stale"], o["behind"])  # fmt: skip
        return np.bincount(self.group, weights=times, minlength=len(self.seconds))


def _with(profile: HardwareProfile, names: Sequence[str], values: np.ndarray) -> HardwareProfile:
    """`profile` with the plain figures in `names` and `kernel:<op>` efficiencies set."""
    plain = {n: float(v) for n, v in zip(names, values) if not n.startswith("kernel:")}
    kernels = {n[7:]: float(v) for n, v in zip(names, values) if n.startswith("kernel:")}
    if kernels:
        plain["kernel_efficiency"] = {**profile.kernel_efficiency, **kernels}
    return dataclasses.replace(profile, **plain)


F_SCALE = 0.05  # the robust loss's scale: residuals (log ratios) beyond ~5% count less


def _least_squares(residuals, start, lo, hi, scale) -> np.ndarray:
    return _solve(residuals, start, lo, hi, scale)[0]


def _solve(residuals, start, lo, hi, scale, loss: str = "soft_l1") -> tuple[np.ndarray, float]:
    """The robust least-squares solution from `start`, and its cost."""
    from scipy.optimize import least_squares

    lo, hi, scale = np.array(lo), np.array(hi), np.array(scale)
    x0 = np.clip(np.array(start, dtype=np.float64), lo, hi) / scale
    result = least_squares(lambda x: residuals(x * scale), x0, bounds=(lo / scale, hi / scale),
                           loss=loss, f_scale=F_SCALE, x_scale="jac", max_nfev=3000)  # fmt: skip
    return result.x * scale, float(result.cost)


def soft_l1(r: np.ndarray) -> np.ndarray:
    """Residuals whose squares sum to scipy's soft-L1 cost of `r` (so a weight can scale
    each one's share of the robust cost)."""
    z = (r / F_SCALE) ** 2
    return np.sign(r) * F_SCALE * np.sqrt(2.0 * (np.sqrt(1.0 + z) - 1.0))


# figures whose residuals are flat over much of their range (the L2 size: above every
# row's bytes nothing moves), so a fit starts from each of these too and keeps the best
MULTI_START = {"l2_bytes": (1e6, 8e6, 3.2e7, 1.28e8), "l2_reuse_bytes": (6.4e7, 9.6e7, 1.6e8, 2.56e8)}


def _starts(names: list[str], start: list[float]) -> list[list[float]]:
    """`start`, and it with each other starting value of the MULTI_START figures."""
    out = [list(start)]
    for name, values in MULTI_START.items():
        if name in names:
            i = names.index(name)
            out += [[*start[:i], v, *start[i + 1:]] for v in values]
    return out


def label_weights(labels: np.ndarray) -> np.ndarray:
    """Residual weights giving every label (prefill, decode, mixed, each kernel) the
    same say in a fit however many rows it has: 1 / sqrt(its rows)."""
    names, index, counts = np.unique(labels, return_inverse=True, return_counts=True)
    return 1.0 / np.sqrt(counts[index])


def fit_ops(profile: HardwareProfile, ops: MeasuredOps, balance: bool = False,
            skip: Sequence[str] = ()) -> HardwareProfile:  # fmt: skip
    """The profile with every figure the measured op kinds can tell fitted to them (but
    `skip`). `balance`: every label (`OpArrays.call`) weighs the same in the fit."""
    table = OpArrays(ops)
    kinds = set(table.op["kind"].tolist())
    stale = bool((table.op["stale"] > 0).any())  # rows that can tell `l2_reuse_bytes`
    names = [n for n, spec in FIGURES.items() if spec[3] in kinds and n not in skip
             and (profile.attention_sms or n not in TILED)
             and (stale or n != "l2_reuse_bytes")]  # fmt: skip
    moving = (table.op["kind"] == ELEMENTWISE) & (table.op["bytes"] > 0)
    kernels = sorted(set(table.op["name"][moving].tolist()))
    lo = [FIGURES[n][0] for n in names] + [KERNEL_BOUNDS[0]] * len(kernels)
    hi = [FIGURES[n][1] for n in names] + [KERNEL_BOUNDS[1]] * len(kernels)
    scale = [FIGURES[n][2] for n in names] + [1.0] * len(kernels)
    start = [getattr(profile, n) or FIGURES[n][2] for n in names] + [0.5] * len(kernels)
    names += [f"kernel:{k}" for k in kernels]
    weights = label_weights(table.call) if balance else None

    def residuals(x: np.ndarray) -> np.ndarray:
        r = np.log(table.predict(_with(profile, names, x)) / table.seconds)
        return r if weights is None else weights * soft_l1(r)

    loss = "soft_l1" if weights is None else "linear"  # weighted: soft-L1 already applied
    best: tuple[np.ndarray, float] | None = None
    for starts in _starts(names, start):
        solution = _solve(residuals, starts, lo, hi, scale, loss)
        if best is None or solution[1] < best[1]:
            best = solution
    assert best is not None
    fitted = _with(profile, names, best[0])
    if kernels:  # element-wise ops without a measured kernel (the final norm): their median
        middle = float(np.median(list(fitted.kernel_efficiency.values())))
        fitted = dataclasses.replace(fitted, elementwise_efficiency=middle)
    return fitted


def collective_times(profile: HardwareProfile, data: np.ndarray, devices: np.ndarray,
                     passes: int = 2) -> np.ndarray:  # fmt: skip
    """`cost_model.collective_time` over arrays (two passes: ring all-reduces; a test
    holds the two equal)."""
    half, exponent = profile.interconnect_half_bytes, profile.interconnect_curve_exponent
    curve = (data / (data + half)) ** exponent if half else 1.0
    latency = profile.interconnect_latency + profile.interconnect_latency_per_device * (devices - 1)
    return latency + passes * (devices - 1) / devices * data / (
        profile.interconnect_bandwidth * curve
    )


def fit_collectives(profile: HardwareProfile, measured: MeasuredCollectives) -> HardwareProfile:
    """The profile with the collective figures fitted to `measured`. The size curve's two
    figures trade off against each other, so the fit starts from a few curves (the same
    ones whatever the profile held) and keeps the best; the floor starts at the fastest
    measurement, the bandwidth at the largest message's."""
    names = list(COLLECTIVE)
    lo, hi, scale = zip(*(COLLECTIVE[n] for n in names))
    largest = int(np.argmax(measured.bytes))
    p = measured.devices[largest]
    bus = measured.passes * (p - 1) / p * measured.bytes[largest] / measured.seconds[largest]
    floor = float(np.min(measured.seconds))

    def residuals(x: np.ndarray) -> np.ndarray:
        fitted = _with(profile, names, x)
        predicted = collective_times(fitted, measured.bytes, measured.devices, measured.passes)
        return np.log(predicted / measured.seconds)

    best: tuple[np.ndarray, float] | None = None
    for half, exponent in ((1e6, 1.0), (1e5, 1.0), (1e7, 0.3), (1e8, 0.2)):
        start = [floor, 1e-6, bus, half, exponent]
        solution = _solve(residuals, start, lo, hi, scale)
        if best is None or solution[1] < best[1]:
            best = solution
    assert best is not None
    fitted = _with(profile, names, best[0])
    if fitted.interconnect_half_bytes < 1.0:  # no curve: say so plainly (the same times)
        fitted = dataclasses.replace(fitted, interconnect_half_bytes=0.0,
                                     interconnect_curve_exponent=1.0)  # fmt: skip
    return fitted


def relative_errors(predicted: np.ndarray, measured: np.ndarray) -> np.ndarray:
    return np.abs(predicted / measured - 1.0)


def errors_by_band(errors: np.ndarray, tokens: np.ndarray) -> dict[str, tuple[float, int]]:
    """Median absolute error and row count: overall and per token-count band."""
    table = {"all": (float(np.median(errors)), len(errors))}
    for lo, hi in BANDS:
        mask = (tokens >= lo) & (tokens <= hi)
        if mask.any():
            label = f"{lo}-{hi}" if hi != float("inf") else f">={lo}"
            table[label] = (float(np.median(errors[mask])), int(mask.sum()))
    return table


def fit_from_vidur(
    profile: HardwareProfile,
    ops: MeasuredOps,
    collectives: MeasuredCollectives | None,
    root: Path,
    commit: str,
) -> tuple[HardwareProfile, dict[str, str]]:
    """The fitted profile and the `sources` entries that say where its figures came from."""
    fitted = fit_ops(profile, ops)
    table = OpArrays(ops)
    op_error = errors_by_band(relative_errors(table.predict(fitted), table.seconds), table.tokens)
    files = sorted({str(Path(f).relative_to(root)) for f in ops.columns["file"]})
    sources = {
        "measured": (
            f"fitted by servelab-calibrate --from-vidur on the measured operator times of "
            f"github.com/microsoft/vidur (MIT licence), commit {commit}, data/profiling: "
            f"{len(ops)} op rows of {len(files)} files ({', '.join(files)}), "
            f"median abs error {op_error['all'][0]:.1%}"
        )
    }
    if collectives is not None:
        fitted = fit_collectives(fitted, collectives)
        predicted = collective_times(fitted, collectives.bytes, collectives.devices, 2)
        error = float(np.median(relative_errors(predicted, collectives.seconds)))
        files = ", ".join(str(Path(f).relative_to(root)) for f in collectives.files)
        sources["interconnect"] = (
            f"interconnect latency, per-device latency, bandwidth and size curve fitted on "
            f"{len(collectives.seconds)} measured all-reduce rows of {files} (same repository "
            f"and commit; `size` read as the message's bytes, Vidur's rule of 2 h bytes per "
            f"token), median abs error {error:.1%}"
        )
    return fitted, sources


def collective_errors(profile: HardwareProfile, measured: MeasuredCollectives) -> np.ndarray:
    """Signed relative errors of the profile's prices of `measured`."""
    predicted = collective_times(profile, measured.bytes, measured.devices, measured.passes)
    return predicted / measured.seconds - 1.0


def fit_from_apex(
    profile: HardwareProfile,
    collectives: dict[str, MeasuredCollectives],
    root: Path,
    gpu: str,
    commit: str,
) -> tuple[HardwareProfile, dict[str, str]]:
    """The profile with its collective figures fitted to APEX's all-reduce rows, and the
    `sources` entry naming them; the other collectives are priced by the fitted figures
    as a check (an all-gather or reduce-scatter is one pass where an all-reduce is two)."""
    reduce = collectives["all_reduce"]
    fitted = fit_collectives(profile, reduce)
    checks = []
    for name, measured in collectives.items():
        error = float(np.median(np.abs(collective_errors(fitted, measured))))
        checks.append(f"{name} {error:.1%} ({len(measured.seconds)} rows)")
    devices = sorted({int(p) for p in reduce.devices})
    span = f"{reduce.bytes.min() / 1024:.0f} KiB-{reduce.bytes.max() / 2**20:.0f} MiB"
    text = (
        f"latency, per-device latency, bandwidth and size curve fitted by servelab-calibrate "
        f"--from-apex on the measured NCCL collective times of github.com/microsoft/apex_plus "
        f"(MIT licence), commit {commit}, profile/comm/{gpu}/all_reduce.csv: "
        f"{len(reduce.seconds)} rows (one node, {', '.join(map(str, devices))} GPUs, half, "
        f"{span}); median abs error by file: {', '.join(checks)}"
    )
    return fitted, {"interconnect": text}


def fit_attention(profile: HardwareProfile, ops: MeasuredOps, root: Path, source: str,
                  commit: str) -> tuple[HardwareProfile, dict[str, str]]:  # fmt: skip
    """The profile with its attention figures fitted to measured attention rows (the other
    figures as they were), and the `sources` entry naming them with the fit's error."""
    fitted = fit_ops(profile, ops)
    table = OpArrays(ops)
    errors = relative_errors(table.predict(fitted), table.seconds)
    calls = ", ".join(f"{call} {np.median(errors[table.call == call]):.1%} "
                      f"({int((table.call == call).sum())} rows)"
                      for call in sorted(set(table.call.tolist())))  # fmt: skip
    files = sorted({str(Path(f).relative_to(root)) for f in ops.columns["file"]})
    text = (
        f"attention figures fitted by servelab-calibrate on the measured attention times of "
        f"{source} (MIT licence), commit {commit}: {', '.join(files)}; median abs error {calls}"
    )
    return fitted, {"attention": text}
