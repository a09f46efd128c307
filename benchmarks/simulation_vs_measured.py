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

All-reduce is also checked the way a simulated step prices it: each held-out row is
turned into the step its source's own size rule maps it to (Vidur: a row of `size`
bytes is size / 2h tokens of hidden size h; APEX: a row of `size(kb)` KiB is
size x 1024 / 2h tokens), and that step's `CostModel.all_reduce_time` is compared with
the measured time. With `--apex DIR` (a local copy of github.com/microsoft/apex_plus,
MIT licence, or its profile/comm) the same check runs on APEX's NCCL measurements
of each GPU there, and the Vidur-fitted H100 profile is priced on APEX's H100 rows:

    python benchmarks/simulation_vs_measured.py VIDUR/data/profiling --apex APEX_PLUS

With `--llmservingsim DIR` (a checkout of github.com/casys-kaist/LLMServingSim at a
commit with llm_profile/perf_models, MIT licence) attention is checked on held-out
models: the attention figures are fitted on each H100 model's attention.csv in turn and
every other model's rows priced, by call (prefill, decode) and size band (a prefill
chunk's tokens, a decode batch's sequences).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from servelab.executor.cost_model import ELEMENTWISE, MATMUL, CostModel, Shape
from servelab.executor.hardware import HardwareProfile, load_profile
from servelab.lab.calibrate_vidur import (
    OpArrays,
    collective_times,
    errors_by_band,
    fit_collectives,
    fit_ops,
    relative_errors,
)
from servelab.lab.vidur_data import MeasuredCollectives, read_all_reduce, read_vidur

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
    assert collectives is not None
    reduce = all_reduce_check(f"{device}, Vidur", fitted, collectives)
    was = signed_step_errors(
        datasheet, collectives.select(~np.isin(collectives.devices, FIT_DEVICES))
    )
    print(f"  (the datasheet profile: median {np.median(np.abs(was)):.1%})")
    return {"ops": float(np.median(after[other_models])), "all_reduce": reduce}


HIDDEN = 8192  # the hidden size the rows are turned into steps of (Llama-2-70B's)


def signed_step_errors(profile: HardwareProfile, rows: MeasuredCollectives) -> np.ndarray:
    """predicted / measured - 1 of each row priced as the step its size rule maps it to:
    a message of b bytes is b / 2h tokens of hidden size h in 16-bit elements, priced by
    `CostModel.all_reduce_time` at tensor parallelism = the row's devices."""
    shape = Shape(HIDDEN, 1, 1, 1, 1, 1, 1)
    models = {int(p): CostModel(shape, profile, "bfloat16", 2, int(p)) for p in set(rows.devices)}
    predicted = [models[int(p)].all_reduce_time(b / (2 * HIDDEN))
                 for b, p in zip(rows.bytes, rows.devices)]  # fmt: skip
    return np.array(predicted) / rows.seconds - 1.0


def _bands(errors: np.ndarray, data: np.ndarray) -> str:
    cells = []
    for lo, hi, label in ((0, 2**16, "< 64 KiB"), (2**16, 2**22, "64 KiB-4 MiB"),
                          (2**22, np.inf, ">= 4 MiB")):  # fmt: skip
        mask = (data >= lo) & (data < hi)
        if mask.any():
            cells.append(f"{label} {np.median(np.abs(errors[mask])):.1%} (n={int(mask.sum())})")
    return ", ".join(cells)


def all_reduce_check(title: str, base: HardwareProfile, rows: MeasuredCollectives) -> float:
    """Fits the collective figures on 2 and 8 devices, prices the 4-device rows as steps."""
    trained = fit_collectives(base, rows.select(np.isin(rows.devices, FIT_DEVICES)))
    test = rows.select(~np.isin(rows.devices, FIT_DEVICES))
    errors = signed_step_errors(trained, test)
    direct = relative_errors(collective_times(trained, test.bytes, test.devices), test.seconds)
    assert np.allclose(np.abs(errors), direct, atol=1e-9)  # the step prices the row's message
    median = float(np.median(np.abs(errors)))
    print(f"all-reduce {title}, {sorted({int(p) for p in test.devices})} devices held out (fit "
          f"on {FIT_DEVICES}): median |error| {median:.1%}, signed {np.median(errors):+.1%}, "
          f"n={len(errors)}; {_bands(errors, test.bytes)}")  # fmt: skip
    return median


def apex_checks(apex: Path, vidur: Path | None) -> None:
    from servelab.lab.apex_data import APEX_GPUS, comm_dir, read_apex

    for name, gpu in APEX_GPUS.items():
        if not (comm_dir(apex) / gpu).is_dir():
            print(f"\n## APEX {gpu}: not in {apex}")
            continue
        measured = read_apex(apex, gpu)
        print(f"\n## APEX {gpu} ({name})")
        all_reduce_check(f"{gpu}, APEX", load_profile(name), measured["all_reduce"])
        fitted = fit_collectives(load_profile(name), measured["all_reduce"])
        for collective, rows in measured.items():
            errors = (
                collective_times(fitted, rows.bytes, rows.devices, rows.passes) / rows.seconds - 1
            )
            print(f"  {collective}, every row, the all-reduce fit on all of them: median "
                  f"|error| {np.median(np.abs(errors)):.1%} (n={len(errors)})")  # fmt: skip
        if name == "h100-sxm" and vidur is not None:
            shipped = fit_collectives(load_profile(name),
                                      read_all_reduce(vidur / "network/h100_dgx/all_reduce.csv"))  # fmt: skip
            errors = signed_step_errors(shipped, measured["all_reduce"])
            print(f"  the Vidur-fitted H100 figures on APEX's H100 all-reduce rows: median "
                  f"|error| {np.median(np.abs(errors)):.1%}, signed {np.median(errors):+.1%}; "
                  f"{_bands(errors, measured['all_reduce'].bytes)}")  # fmt: skip


def attention_checks(root: Path) -> None:
    from servelab.lab.llmservingsim_data import perf_dir, read_llmservingsim

    ops = read_llmservingsim(perf_dir(root), "H100")
    models = sorted(set(ops.columns["model"]))
    base = load_profile("h100-sxm")
    for fit_model in models:
        mine = np.array(ops.columns["model"]) == fit_model
        fitted = fit_ops(base, ops.select(mine))
        held = OpArrays(ops.select(~mine))
        errors = relative_errors(held.predict(fitted), held.seconds)
        print(f"\n## attention, H100: fit on {fit_model}, held out {', '.join(sorted(set(held.model)))}")
        for call in ("prefill", "decode"):
            mask = held.call == call
            table = errors_by_band(errors[mask], held.tokens[mask])
            cells = " | ".join(f"{b} {e:.1%} (n={n})" for b, (e, n) in table.items())
            print(f"| {call} | {cells} |")
        print(f"| all | {np.median(errors):.1%} (n={len(errors)}) |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("vidur", nargs="?", type=Path, help="Vidur's data/profiling")
    parser.add_argument("--apex", type=Path, help="apex_plus (or its profile/comm)")
    parser.add_argument("--llmservingsim", type=Path, help="LLMServingSim (llm_profile)")
    args = parser.parse_args(argv)
    if args.vidur is None and args.apex is None and args.llmservingsim is None:
        print(__doc__)
        return 2
    if args.vidur is not None:
        for device in DEVICES:
            compare(args.vidur, device)
    if args.apex is not None:
        apex_checks(args.apex, args.vidur)
    if args.llmservingsim is not None:
        attention_checks(args.llmservingsim)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
