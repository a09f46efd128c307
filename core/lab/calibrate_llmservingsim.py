"""`servelab-calibrate --from-llmservingsim DIR`: fit a GPU profile to LLMServingSim's
measured operator times (read by `llmservingsim_data`).

A checkout with profile bundles for the GPU (`profiler/perf/<GPU>/`) gives every
figure the bundles can tell: the matmul, element-wise and launch figures from
`dense.csv` and `per_sequence.csv` (the LM head), then the attention figures from
`attention.csv`. One with v0 profiles only (`perf_models/<GPU>/`) gives the attention
figures. The attention kernel's structure (`llmservingsim_data.KERNELS`: whether a
decode's query heads share a block per KV head, and in which steps; whether prefill
chunks and decodes are one call) is not a figure a least-squares fit can move, so
each kernel is fitted in turn and the one with the least error kept; the others'
errors are written beside it. Every fit weighs each label (a kernel's name; prefill,
decode, mixed) alike, however many rows it has.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from servelab.executor.cost_model import ATTENTION
from servelab.executor.hardware import HardwareProfile
from servelab.lab.calibrate_vidur import OpArrays, fit_ops, relative_errors
from servelab.lab.llmservingsim_data import (
    KERNELS,
    Kernel,
    bundle_dir,
    has_bundles,
    perf_dir,
    read_bundles,
    read_llmservingsim,
)
from servelab.lab.vidur_data import MeasuredOps

SOURCE = "github.com/casys-kaist/LLMServingSim (MIT licence)"


def split_attention(ops: MeasuredOps) -> tuple[MeasuredOps, MeasuredOps]:
    """The measurements without attention ops, and those with."""
    groups = np.asarray(ops.columns["group"])
    kinds = np.asarray(ops.columns["kind"])
    attention = np.isin(groups, np.unique(groups[kinds == ATTENTION]))
    return ops.select(~attention), ops.select(attention)


def label_medians(profile: HardwareProfile, ops: MeasuredOps) -> dict[str, tuple[float, int]]:
    """Median abs error and rows of each label."""
    table = OpArrays(ops)
    errors = relative_errors(table.predict(profile), table.seconds)
    return {label: (float(np.median(errors[table.call == label])), int((table.call == label).sum()))
            for label in sorted(set(table.call.tolist()))}  # fmt: skip


def describe(medians: dict[str, tuple[float, int]]) -> str:
    return ", ".join(f"{label} {e:.1%} ({n} rows)" for label, (e, n) in medians.items())


def overall(profile: HardwareProfile, ops: MeasuredOps) -> float:
    """The median abs error over every measurement."""
    table = OpArrays(ops)
    return float(np.median(relative_errors(table.predict(profile), table.seconds)))


@dataclass
class KernelFit:
    """The attention kernel that fits the measured rows best, and how the others did."""

    profile: HardwareProfile  # its attention figures fitted to the rows
    name: str
    rows: MeasuredOps  # `read(kernel)` for it
    errors: dict[str, dict[str, tuple[float, int]]]  # every kernel's, by label

    def others(self) -> str:
        """`; the other kernels: ...` (empty when there is no other)."""
        text = "; ".join(f"{k}: {describe(v)}" for k, v in self.errors.items() if k != self.name)
        return f"; the other kernels: {text}" if text else ""


def fit_kernels(profile: HardwareProfile, read: Callable[[Kernel], MeasuredOps],
                kernels: dict[str, dict[str, float]] = KERNELS) -> KernelFit:  # fmt: skip
    """The profile with its attention figures fitted to `read(kernel)`'s attention rows
    for the kernel that fits them best (the mean of its labels' median errors)."""
    best: KernelFit | None = None
    best_score = 0.0
    errors: dict[str, dict[str, tuple[float, int]]] = {}
    for name, kernel in kernels.items():
        rows = read(kernel)
        _, attention = split_attention(rows)
        fitted = fit_ops(profile.with_fitted(**kernel), attention, balance=True)
        errors[name] = label_medians(fitted, attention)
        score = float(np.mean([e for e, _ in errors[name].values()]))
        if best is None or score < best_score:
            best, best_score = KernelFit(fitted, name, rows, errors), score
    assert best is not None
    return best


def _files(ops: MeasuredOps, root: Path) -> str:
    """The measured files, folders with the same file names together:
    `a/tp4, b/tp4: attention.csv; ...`."""
    files = sorted({Path(f).relative_to(root) for f in ops.columns["file"]})
    by_names: dict[tuple[str, ...], list[str]] = {}
    for folder in sorted({f.parent for f in files}):
        names = tuple(sorted(f.name for f in files if f.parent == folder))
        by_names.setdefault(names, []).append(str(folder))
    return "; ".join(f"{', '.join(folders)}: {', '.join(names)}"
                     for names, folders in by_names.items())  # fmt: skip


def fit_from_llmservingsim(profile: HardwareProfile, root: Path, gpu: str, commit: str,
                           configs: Path | None = None,
                           kernels: dict[str, dict[str, float]] = KERNELS,
                           measured_bandwidth: float | None = None,
                           ) -> tuple[HardwareProfile, dict[str, str]]:  # fmt: skip
    """The fitted profile and the `sources` entries naming what each figure came from.
    `measured_bandwidth`: the peak memory bandwidth of the GPU the data was measured on,
    when it is not the profile's (a sibling with the same cores): the rows are priced
    at it, and the fitted figures, shares of the peaks and per-core times, carry over."""
    if measured_bandwidth:
        own = profile.memory_bandwidth
        fitted, sources = fit_from_llmservingsim(
            profile.with_fitted(memory_bandwidth=measured_bandwidth), root, gpu, commit,
            configs, kernels)  # fmt: skip
        note = (f" (measured on {gpu}, of {measured_bandwidth / 1e12:.3g} TB/s peak memory "
                f"bandwidth: the figures are shares of peak and per-core times, carried over)")  # fmt: skip
        return fitted.with_fitted(memory_bandwidth=own), {k: v + note for k, v in sources.items()}
    root = Path(root)
    if not has_bundles(root, gpu):  # v0: attention only
        base = perf_dir(root)
        fit = fit_kernels(profile, lambda k: read_llmservingsim(base, gpu, k), kernels)
        ops = fit.rows
        text = (
            f"attention figures fitted by servelab-calibrate --from-llmservingsim on the "
            f"measured attention times of {SOURCE}, commit {commit}: {_files(ops, base)} "
            f"({len(ops)} rows); kernel {fit.name}, median abs error "
            f"{overall(fit.profile, ops):.1%} (by call: {describe(fit.errors[fit.name])})"
            f"{fit.others()}"
        )
        return fit.profile, {"attention": text}
    bundles = bundle_dir(root)
    assert bundles is not None
    dense = read_bundles(root, gpu, configs, attention=False, empty=True)
    fitted = fit_ops(profile, dense, balance=True) if len(dense) else profile
    dense_text = (
        f"matmul, element-wise and launch figures fitted by servelab-calibrate "
        f"--from-llmservingsim on the operator times {SOURCE} measured inside vLLM, commit "
        f"{commit}: {_files(dense, bundles)} ({len(dense)} rows: a decoder layer's kernels "
        f"and the LM head, tensor-parallel ranks emulated on one GPU); median abs error "
        f"{overall(fitted, dense):.1%} (by kernel: {describe(label_medians(fitted, dense))})"
        if len(dense) else ""
    )
    fit = fit_kernels(
        fitted, lambda k: read_bundles(root, gpu, configs, kernel=k, attention=True), kernels)
    fitted, attention = fit.profile, fit.rows
    attention_text = (
        f"attention figures fitted the same way on {_files(attention, bundles)} ({len(attention)} "
        f"rows: prefill chunks, decode batches and both in one call); kernel {fit.name}, median "
        f"abs error {overall(fitted, attention):.1%} (by call: {describe(fit.errors[fit.name])})"
        f"{fit.others()}"
    )
    if not len(dense):  # attention.csv alone
        return fitted, {"attention": attention_text.replace(" the same way", " by servelab-calibrate "
                        f"--from-llmservingsim on the operator times {SOURCE} measured inside "
                        f"vLLM, commit {commit},")}  # fmt: skip
    return fitted, {"measured": dense_text, "attention": attention_text}
