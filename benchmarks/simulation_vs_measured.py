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

With `--llmservingsim DIR` (a checkout of github.com/casys-kaist/LLMServingSim, MIT
licence) attention is checked on held-out models: the attention figures are fitted on
each H100 model's v0 attention.csv in turn and every other model's rows priced, by call
(prefill, decode) and size band (a prefill chunk's tokens, a decode batch's sequences);
and where the checkout has profile bundles (profiler/perf/<GPU>/, vLLM's own kernels) every
operator is checked the same way: the profile fitted on one model's bundle (every TP
degree), each other model's rows priced, by operator (each dense kernel, the LM head,
attention's prefill, decode and mixed calls) and size band.

With `--ground-truth DIR` (repeatable) measured serving runs of vLLM are replayed
through the simulated executor (`servelab.lab.ground_truth`): inference-sim's
eval/ground_truth/<run>/ (github.com/inference-sim/inference-sim, Apache-2.0, commit
e7a4aa3; model configs from its model_configs/) and LLMServingSim's
bench/examples/<GPU>/<model>/vllm/. Each run's requests arrive when they did with their
prompt and output lengths, under its engine settings; printed: the measured and
simulated means of TTFT, TPOT and E2E and their errors, per run and the median over
runs; `--out DIR` writes them (ground_truth.json, .md) and a plot of the simulated and
measured distributions (ground_truth.png). `--hardware GPU=PROFILE` picks the profile
for a GPU (H100=h100-sxm-fa3: vLLM's FlashAttention 3; the default).
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


CLASSES = {
    "linear": ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"),
    "element-wise": ("act_fn", "rotary_emb", "layernorm", "final_layernorm"),
    "attention": ("prefill", "decode", "mixed"),
}


def _by_model(ops, model: str, keep: bool):
    mine = np.array(ops.columns["model"]) == model
    return ops.select(mine if keep else ~mine)


def bundle_checks(root: Path, gpu: str, profile: str) -> dict:
    """Every operator of a GPU's bundles, one model at a time: the profile fitted on that
    model's rows (every TP degree; the attention kernel picked as the calibration does),
    every other model's rows priced (held out). Prints and returns the median |predicted /
    measured - 1| by operator and by class, by size band (tokens; a decode: sequences)."""
    from servelab.lab.calibrate_llmservingsim import fit_kernels
    from servelab.lab.llmservingsim_data import KERNELS, read_bundles

    dense = read_bundles(root, gpu, attention=False)
    out: dict = {}
    labels = np.array(dense.columns["label"])
    models = np.array(dense.columns["model"])
    # a model without every dense kernel (an MoE model: no gate_up_proj) cannot tell them
    whole = [m for m in sorted(set(models.tolist())) if "gate_up_proj" in set(labels[models == m])]
    for model in whole:
        fitted = fit_ops(load_profile(profile), _by_model(dense, model, True), balance=True)

        def attention_of(kernel, model=model):
            return _by_model(read_bundles(root, gpu, kernel=kernel, attention=True), model, True)

        fit = fit_kernels(fitted, attention_of)
        fitted, kernel = fit.profile, fit.name
        attention = read_bundles(root, gpu, kernel=KERNELS[kernel], attention=True)
        held = [OpArrays(_by_model(dense, model, False)), OpArrays(_by_model(attention, model, False))]
        names = sorted(set(held[0].model))
        print(f"\n## {gpu}: fit on {model} (kernel {kernel}), held out {', '.join(names)}")
        rows = {}
        for table in held:
            errors = relative_errors(table.predict(fitted), table.seconds)
            groups = {label: table.call == label for label in sorted(set(table.call.tolist()))}
            groups.update({f"**{name}**": np.isin(table.call, labels) for name, labels in CLASSES.items()})
            for name, mask in groups.items():
                if mask.any():
                    bands = errors_by_band(errors[mask], table.tokens[mask])
                    rows[name.strip("*")] = {b: [e, n] for b, (e, n) in bands.items()}
                    cells = " | ".join(f"{b} {e:.1%} (n={n})" for b, (e, n) in bands.items())
                    print(f"| {name} | {cells} |")
        out[model] = rows
    return out


def ground_truth(roots: list[Path], hardware: dict[str, str], out: Path | None) -> list[dict]:
    """Replays every measured run under `roots`; prints and returns the errors of the means."""
    import tempfile

    from servelab.lab.ground_truth import PROFILES, find_runs, replay, unsupported

    runs = [run for root in roots for run in find_runs(root)]
    profiles = {**PROFILES, "H100": "h100-sxm-fa3", **hardware}
    results, replays = [], []
    print("\n| run | GPU, profile | requests | TTFT mean s (sim / meas, err) | TPOT mean ms "
          "(sim / meas, err) | E2E mean s (sim / meas, err) |\n|---|---|---|---|---|---|")  # fmt: skip
    for run in runs:
        why = unsupported(run)
        if why:
            print(f"| {run.name} | {run.gpu} | {len(run.arrival)} | skipped: {why} | | |")
            continue
        with tempfile.TemporaryDirectory() as folder:
            r = replay(run, Path(folder), profiles[run.gpu])
        errors = r.mean_errors()
        row = {"run": run.name, "source": run.source, "gpu": run.gpu, "hardware": r.hardware,
               "model": run.model, "tp": run.tensor_parallel, "requests": len(run.arrival),
               "vllm": run.vllm_version, "wall_s": r.wall_seconds}  # fmt: skip
        for key, scale in (("ttft", 1.0), ("tpot", 1e3), ("e2e", 1.0)):
            row[key] = {"simulated": float(np.nanmean(getattr(r, key))) * scale,
                        "measured": float(np.nanmean(getattr(run, key))) * scale,
                        "error": errors[key]}  # fmt: skip
        cells = " | ".join(f"{row[k]['simulated']:.4g} / {row[k]['measured']:.4g}, "
                           f"{row[k]['error']:+.1%}" for k in ("ttft", "tpot", "e2e"))  # fmt: skip
        print(f"| {run.name} | {run.gpu}, {r.hardware} | {len(run.arrival)} | {cells} |", flush=True)
        results.append(row)
        replays.append(r)
    medians = {k: float(np.median([abs(r[k]["error"]) for r in results])) for k in ("ttft", "tpot", "e2e")}
    print(f"| median abs error over {len(results)} runs | | | **{medians['ttft']:.1%}** | "
          f"**{medians['tpot']:.1%}** | **{medians['e2e']:.1%}** |")  # fmt: skip
    if out is not None:
        import json

        out.mkdir(parents=True, exist_ok=True)
        (out / "ground_truth.json").write_text(json.dumps({"runs": results, "medians": medians}, indent=1))
        plot_ground_truth(replays, out / "ground_truth.png")
        print(f"wrote {out / 'ground_truth.json'}, {out / 'ground_truth.png'}")
    return results


def plot_ground_truth(replays, path: Path) -> None:
    """One row per replayed run: the measured and simulated distributions (CDFs) of
    TTFT, TPOT and E2E."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(replays), 3, figsize=(13, 2.6 * len(replays)), squeeze=False)
    for row, r in zip(axes, replays):
        for ax, (key, title, scale) in zip(row, (("ttft", "TTFT (s)", 1.0), ("tpot", "TPOT (ms)", 1e3),
                                                 ("e2e", "E2E (s)", 1.0))):  # fmt: skip
            for values, label, style in ((getattr(r.run, key), "measured (vLLM)", "-"),
                                         (getattr(r, key), f"simulated ({r.hardware})", "--")):  # fmt: skip
                v = np.sort(values[np.isfinite(values)]) * scale
                ax.plot(v, np.arange(1, len(v) + 1) / len(v), style, label=label)
            error = r.mean_errors()[key]
            ax.set_title(f"{r.run.name}: {title}, mean {error:+.1%}", fontsize=9)
            if key != "tpot":
                ax.set_xscale("log")
            ax.grid(alpha=0.3)
        row[0].set_ylabel("share of requests")
        row[0].legend(fontsize=7, loc="upper left")
    fig.suptitle("simulated: executor=simulated, virtual time; measured: vLLM serving runs "
                 "(inference-sim, LLMServingSim)", fontsize=10)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("vidur", nargs="?", type=Path, help="Vidur's data/profiling")
    parser.add_argument("--apex", type=Path, help="apex_plus (or its profile/comm)")
    parser.add_argument("--llmservingsim", type=Path, help="an LLMServingSim checkout")
    parser.add_argument("--ground-truth", type=Path, action="append", default=[],
                        help="measured vLLM serving runs to replay (repeatable)")  # fmt: skip
    parser.add_argument("--hardware", action="append", default=[], metavar="GPU=PROFILE",
                        help="the profile replaying a GPU's runs (H100=h100-sxm)")  # fmt: skip
    parser.add_argument("--out", type=Path, help="write the replay's tables and plot here")
    args = parser.parse_args(argv)
    if args.vidur is None and args.apex is None and args.llmservingsim is None and not args.ground_truth:
        print(__doc__)
        return 2
    if args.vidur is not None:
        for device in DEVICES:
            compare(args.vidur, device)
    if args.apex is not None:
        apex_checks(args.apex, args.vidur)
    if args.llmservingsim is not None:
        from servelab.lab.llmservingsim_data import LLMSERVINGSIM_GPUS, has_bundles, perf_dir

        if (perf_dir(args.llmservingsim) / "H100").is_dir():
            attention_checks(args.llmservingsim)
        for profile, gpu in LLMSERVINGSIM_GPUS.items():
            if has_bundles(args.llmservingsim, gpu):
                bundle_checks(args.llmservingsim, gpu, profile)
    if args.ground_truth:
        hardware = dict(item.split("=", 1) for item in args.hardware)
        ground_truth(args.ground_truth, hardware, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
