"""The simulated GPU against measured GPU operator times (Vidur's profiles).

For each device (A100, H100) it fits a profile on some models at some
tensor-parallel degrees, then prints the per-operator error (median |predicted /
measured - 1|) on rows the fit never saw: other models (other sizes, all TP
degrees) and the fit's models at other TP degrees, by token-count band, for linear
layers, element-wise kernels and all ops; and the all-reduce error on a device
count the fit never saw. The "before" column is the profile as it was before
fitting (datasheet peaks x estimated efficiencies). Needs a local copy of Vidur's
data/profiling (github.com/microsoft/vidur, MIT licence):

    python benchmarks/simulation_vs_measured.py VIDUR/data/profiling
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from servelab.executor.cost_model import ELEMENTWISE, MATMUL
from servelab.executor.hardware import HardwareProfile, load_profile
from servelab.lab.calibrate_vidur import (
    OpArrays,
    collective_times,
    errors_by_band,
    fit_collectives,
    fit_ops,
    relative_errors,
)
from servelab.lab.vidur_data import read_vidur

DEVICES = {"h100": ("h100-sxm", "h100_dgx"), "a100": ("a100-80g", "a100_dgx")}
FIT_MODELS = ("meta-llama/Llama-2-7b-hf", "meta-llama/Llama-2-70b-hf", "Qwen/Qwen-72B")
FIT_TP = (1, 4)
FIT_DEVICES = (2, 8)  # all-reduce; 4 is held out


def _table(title: str, before: np.ndarray, after: np.ndarray, ops: OpArrays, mask) -> None:
    old = errors_by_band(before[mask], ops.tokens[mask])
    new = errors_by_band(after[mask], ops.tokens[mask])
    cells = " | ".join(f"{band} {new[band][0]:.1%} (was {old[band][0]:.1%}, n={new[band][1]})"
                       for band in new)  # fmt: skip
    print(f"| {title} | {cells} |")


def compare(root: Path, device: str) -> dict:
    name, network = DEVICES[device]
    shipped: HardwareProfile = load_profile(name)
    # the datasheet figures this profile had before it was fitted: the starting point
    datasheet = shipped.with_fitted(
        matmul_efficiency=0.75, attention_efficiency=0.5, bandwidth_efficiency=0.85,
        matmul_half_rows=0.0, elementwise_efficiency=0.0, elementwise_full_rows=0.0,
        kernel_efficiency={}, matmul_overhead=0.0,
        launch_overhead=4e-6 if device == "h100" else 5e-6,
        interconnect_latency=8e-6 if device == "h100" else 1e-5,
        interconnect_half_bytes=0.0,
        interconnect_bandwidth=450e9 if device == "h100" else 300e9,
    )  # fmt: skip
    ops, collectives = read_vidur(root, device, network)
    model, tp = np.array(ops.columns["model"]), np.array(ops.columns["tp"])
    fit = np.isin(model, FIT_MODELS) & np.isin(tp, FIT_TP)
    fitted = fit_ops(datasheet, ops.select(fit))
    held = OpArrays(ops.select(~fit))
    after = relative_errors(held.predict(fitted), held.seconds)
    before = relative_errors(held.predict(datasheet), held.seconds)
    other_models = ~np.isin(held.model, FIT_MODELS)
    print(f"\n## {device}: fit on {', '.join(FIT_MODELS)} at TP {FIT_TP} ({int(fit.sum())} rows)")
    print(f"held-out models: {', '.join(sorted(set(held.model[other_models])))}\n")
    for title, mask in (
        ("linear, held-out models", other_models & (held.kind == MATMUL)),
        ("element-wise, held-out models", other_models & (held.kind == ELEMENTWISE)),
        ("all ops, held-out models", other_models),
        ("linear, fit models at TP 2 and 8", ~other_models & (held.kind == MATMUL)),
        ("all ops, every held-out row", np.ones(len(held.seconds), bool)),
    ):
        _table(title, before, after, held, mask)
    small = (held.kind == ELEMENTWISE) & (held.tokens <= 64)
    gap = np.median(np.abs(held.predict(fitted)[small] - held.seconds[small])) * 1e6
    print(f"element-wise at <= 64 tokens: median |error| {gap:.2f} us "
          f"(measured {np.median(held.seconds[small]) * 1e6:.1f} us, timer steps of 1 us)")  # fmt: skip
    trained = fit_collectives(fitted, collectives.select(np.isin(collectives.devices, FIT_DEVICES)))
    test = collectives.select(~np.isin(collectives.devices, FIT_DEVICES))
    error = relative_errors(collective_times(trained, test.bytes, test.devices), test.seconds)
    was = relative_errors(collective_times(datasheet, test.bytes, test.devices), test.seconds)
    print(f"all-reduce on {sorted(set(test.devices.astype(int).tolist()))} devices (fit on "
          f"{FIT_DEVICES}): median {np.median(error):.1%} (was {np.median(was):.1%}, "
          f"n={len(error)})")  # fmt: skip
    return {"ops": float(np.median(after[other_models])), "all_reduce": float(np.median(error))}


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    for device in DEVICES:
        compare(Path(argv[0]), device)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
