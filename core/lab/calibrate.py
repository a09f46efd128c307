"""`servelab-calibrate`: fit a hardware profile's efficiencies and host overheads
to the real engine's step times on this machine.

It serves a grid of workloads through the real engine (decode batch sizes x
context lengths, whole prompts, prompt chunks next to decodes), records each
step's shape (`cost_model.step_shape`) and its measured time, and fits
`FIT_PARAMETERS` by least squares on the relative error (scipy), the profile's
peaks held fixed. The launch overhead is kept: a step's launch count barely
varies, so it cannot be told apart from the per-step overhead. With
`--from-vidur DIR` it fits a GPU profile to measured operator times instead
(`calibrate_vidur`), with `--from-apex DIR` its collective figures to measured NCCL
times (`apex_data`), with `--from-llmservingsim DIR` to operator times measured inside
vLLM or attention times (`calibrate_llmservingsim`).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import platform
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from servelab.engine.build import build_engine
from servelab.executor.cost_model import CostModel, Shape, StepShape, step_shape
from servelab.executor.hardware import HardwareProfile, load_profile
from servelab.lab.op_times import op_times
from servelab.llm import EngineLoop
from servelab.step.sequence import SamplingParams

FIT_PARAMETERS = (
    "matmul_efficiency",
    "attention_efficiency",
    "bandwidth_efficiency",
    "matmul_half_rows",
    "step_overhead",
    "seq_overhead",
)
# per kind of parameter: its bounds, and the scale that lets each move on a similar step
KINDS = {
    "efficiency": ((1e-5, 1.0), 1.0),
    "half_rows": ((0.0, 1e5), 100.0),
    "overhead": ((0.0, 1.0), 1e-4),  # seconds: microseconds to milliseconds
}


def _kind(parameter: str) -> str:
    return next(k for k in KINDS if parameter.endswith(k))


def _bounds() -> tuple[list[float], list[float]]:
    pairs = [KINDS[_kind(p)][0] for p in FIT_PARAMETERS]
    return [lo for lo, _ in pairs], [hi for _, hi in pairs]


def predict(
    profile: HardwareProfile, shape: Shape, steps: Sequence[StepShape], dtype: str, size: int
) -> np.ndarray:
    model = CostModel(shape, profile, dtype, size)
    return np.array([model.step_time(s) for s in steps])


class OpTable:
    """Every op of every step as flat arrays, built once: a fit evaluates thousands of
    profiles over the same steps, and only the rates change between them. `times` is
    `CostModel.step_time` vectorised (a test holds the two equal); one device."""

    def __init__(self, shape: Shape, steps: Sequence[StepShape], dtype: str, size: int) -> None:
        model = CostModel(shape, HardwareProfile("table", 1, {dtype: 1.0}, 1.0), dtype, size)
        cols: dict[str, list] = {
            k: []
            for k in ("step", "kind", "call", "name", "flops", "bytes", "rows", "launches", "count")
        }
        for i, step in enumerate(steps):
            weighted = [(op, shape.num_layers) for op in model.layer_ops(step)]
            weighted += [(op, 1) for op in model.step_ops(step)]
            for op, count in weighted:
                for key, value in (("step", i), ("kind", op.kind), ("call", op.call), ("name", op.name), ("flops", op.flops),
                                   ("bytes", op.bytes), ("rows", op.rows),
                                   ("launches", op.launches), ("count", count)):  # fmt: skip
                    cols[key].append(value)
        self.dtype, self.num_steps = dtype, len(steps)
        self.kind, self.call = np.array(cols.pop("kind")), np.array(cols.pop("call"))
        self.name = np.array(cols.pop("name"))
        for key, values in cols.items():
            setattr(self, key, np.asarray(values, dtype=np.float64))
        self.step = self.step.astype(np.int64)
        self.seqs = np.array([s.num_seqs for s in steps], dtype=np.float64)

    def times(self, profile: HardwareProfile) -> np.ndarray:
        per_op = op_times(profile, self.dtype, self.kind, self.flops, self.bytes, self.rows,
                          self.launches, self.call, self.name)  # fmt: skip
        ops = np.bincount(self.step, weights=per_op * self.count, minlength=self.num_steps)
        return ops + profile.step_overhead + profile.seq_overhead * self.seqs


def fit_profile(
    profile: HardwareProfile,
    shape: Shape,
    steps: Sequence[StepShape],
    measured: Sequence[float],
    dtype: str,
    bytes_per_element: int,
) -> HardwareProfile:
    """The profile with `FIT_PARAMETERS` fitted to `measured` (seconds per step)."""
    from scipy.optimize import least_squares

    want = np.asarray(measured, dtype=np.float64)
    lo, hi = _bounds()
    start = np.clip([getattr(profile, p) for p in FIT_PARAMETERS], lo, hi)
    scale = np.array([KINDS[_kind(p)][1] for p in FIT_PARAMETERS])

    table = OpTable(shape, steps, dtype, bytes_per_element)

    def residuals(x: np.ndarray) -> np.ndarray:
        fitted = profile.with_fitted(**dict(zip(FIT_PARAMETERS, x * scale)))
        return table.times(fitted) / want - 1.0

    result = least_squares(
        residuals,
        start / scale,
        bounds=(np.array(lo) / scale, np.array(hi) / scale),
        x_scale="jac",
        xtol=1e-12,
        ftol=1e-12,
        gtol=1e-12,
        max_nfev=2000,
    )
    return profile.with_fitted(**{p: float(v) for p, v in zip(FIT_PARAMETERS, result.x * scale)})


# -- measuring the real engine
GRID_DECODE = [(b, c) for b in (1, 4, 16, 32) for c in (16, 128, 384)]  # batch x prompt length
GRID_CHUNKED = [(64, 256), (128, 384)]  # chunk size x prompt length, next to decodes
# served workloads, the step mixes of live traffic: single prompts of many lengths arriving
# beside small decode batches; (scheduler, its options, prompt range, output range, rate)
TRAFFIC = [
    ("continuous", {}, (16, 384), (8, 96), 6.0),
    ("chunked", {"chunk_size": 96}, (64, 448), (8, 64), 8.0),
]
TRAFFIC_REQUESTS = 24


def _engine(model: str, dtype: str, threads: int | None, scheduler: str, options: dict,
            device: str = "cpu"):  # fmt: skip
    return build_engine({
        "model": model,
        "scheduler": {"name": scheduler, **options},
        "engine": {"dtype": dtype, "kv_cache_memory": "256MiB", "max_model_len": 1024,
                   "num_threads": threads, "device": device},
    })  # fmt: skip


def _traffic(engine, prompts: tuple, outputs: tuple, rate: float, seed: int) -> list:
    from servelab.lab.workload import make_workload

    node = {"name": "synthetic", "num_requests": TRAFFIC_REQUESTS, "arrival": "poisson",
            "rate": rate, "seed": seed, "ignore_eos": True,
            "prompt_len": {"dist": "uniform", "min": prompts[0], "max": prompts[1]},
            "output_len": {"dist": "uniform", "min": outputs[0], "max": outputs[1]}}  # fmt: skip
    return make_workload(node, engine.model_config.vocab_size, engine.max_model_len)


def measure(
    model: str = "bench",
    dtype: str = "float32",
    repeats: int = 2,
    threads: int | None = None,
    device: str = "cpu",
) -> dict:
    """Serves the grid and the traffic through the real engine; each step's shape and seconds."""
    from servelab.lab.runner import serve, warm_up

    shapes: list[StepShape] = []
    seconds: list[float] = []
    runs = [("continuous", {}, batch, length, 8) for batch, length in GRID_DECODE]
    runs += [("chunked", {"chunk_size": c}, 8, length, 16) for c, length in GRID_CHUNKED]
    engine = None

    def keep(recorded: list, slept: set[int]) -> None:
        """Each step's time is its period: from its start to the next step's start,
        so the host work between steps (outputs, arrivals) is in it, as a virtual
        clock that moves only by step costs needs; a step followed by a sleep (an
        idle wait for an arrival) or by nothing counts its own wall time."""
        steps = engine.metrics.steps
        for i, (plan, step) in enumerate(zip(recorded, steps)):
            shapes.append(step_shape(plan, padded=False))
            follows = i + 1 < len(steps) and (i + 1) not in slept
            seconds.append(steps[i + 1].start_time - step.start_time if follows else step.wall_time)

    for repeat in range(repeats):
        for scheduler, options, batch, length, out in runs:
            engine = _engine(model, dtype, threads, scheduler, options, device)
            recorded, slept = _record(engine)
            params = SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True)
            rng = np.random.default_rng(length * 1000 + batch)
            vocab = engine.model_config.vocab_size
            prompts = [rng.integers(4, vocab, length).tolist() for _ in range(batch)]
            loop = EngineLoop(engine)
            loop.generate([[2, 3, 4]], SamplingParams(max_tokens=2))  # warm-up
            recorded.clear()
            slept.clear()
            engine.metrics.start_run()
            loop.generate(prompts, params)
            keep(recorded, slept)
        for scheduler, options, prompts, outputs, rate in TRAFFIC:
            engine = _engine(model, dtype, threads, scheduler, options, device)
            recorded, slept = _record(engine)
            warm_up(engine)
            recorded.clear()
            slept.clear()
            serve(engine, _traffic(engine, prompts, outputs, rate, seed=100 + repeat))
            keep(recorded, slept)
    return {"shapes": shapes, "seconds": seconds, "shape": Shape.of(engine.model_config)}


def _record(engine) -> tuple[list, set[int]]:
    """Keeps each executed plan (in step order) beside the engine's step records,
    and the indices of the steps that came after an idle sleep."""
    plans: list = []
    slept: set[int] = set()
    execute, sleep = engine.executor.execute, engine.sleep

    def recording(plan):
        plans.append(plan)
        return execute(plan)

    def sleeping(seconds: float) -> None:
        slept.add(len(engine.metrics.steps))
        sleep(seconds)

    engine.executor.execute = recording
    engine.sleep = sleeping
    return plans, slept


def write_profile(profile: HardwareProfile, path: Path, note: str | None) -> None:
    import yaml

    values = dataclasses.asdict(profile)
    if note is not None:
        values["sources"] = {**values["sources"], "fitted": note}
    path.write_text(yaml.safe_dump(values, sort_keys=False))


def _save_steps(path: Path, data: dict) -> None:
    shapes = data["shapes"]
    np.savez(
        path,
        seconds=np.array(data["seconds"]),
        prefill_q=np.array([s.prefill_q.tolist() for s in shapes], dtype=object),
        prefill_start=np.array([s.prefill_start.tolist() for s in shapes], dtype=object),
        decode_keys=np.array([s.decode_keys.tolist() for s in shapes], dtype=object),
        sampling=np.array([s.sampling for s in shapes]),
    )


def median_abs_error(predicted: np.ndarray, measured: np.ndarray) -> float:
    return float(np.median(np.abs(predicted / measured - 1.0)))


VIDUR_DEVICES = {"a100-80g": ("a100", "a100_dgx"), "h100-sxm": ("h100", "h100_dgx")}


def from_vidur(args: argparse.Namespace, base: HardwareProfile) -> int:
    """Fits `base` to Vidur's measured operator times under `args.from_vidur`."""
    from servelab.errors import ConfigError
    from servelab.lab.calibrate_vidur import fit_from_vidur
    from servelab.lab.vidur_data import read_vidur

    device, network = args.vidur_device, args.vidur_network
    if device is None:
        if base.name not in VIDUR_DEVICES:
            raise ConfigError(
                f"no Vidur device known for profile {base.name!r}; pass --vidur-device "
                f"(Vidur has: a100, h100, a40) or a profile of {', '.join(VIDUR_DEVICES)}"
            )
        device, network = VIDUR_DEVICES[base.name][0], network or VIDUR_DEVICES[base.name][1]
    ops, collectives = read_vidur(args.from_vidur, device, network)
    fitted, sources = fit_from_vidur(base, ops, collectives, Path(args.from_vidur),
                                     args.vidur_commit)  # fmt: skip
    kept = {k: v for k, v in base.sources.items() if k != "efficiencies"}  # now measured
    others = {k: v for k, v in sources.items() if k != "measured"}
    fitted = fitted.with_fitted(sources={**kept, **others}, basis="measured")
    write_profile(fitted, args.out, sources["measured"])
    for text in sources.values():
        print(text)
    print(f"wrote {args.out}")
    return 0


def from_apex(args: argparse.Namespace, base: HardwareProfile) -> int:
    """Fits `base`'s collective figures to APEX's measured NCCL times under `args.from_apex`."""
    from servelab.errors import ConfigError
    from servelab.lab.apex_data import APEX_GPUS, read_apex
    from servelab.lab.calibrate_vidur import fit_from_apex

    gpu = args.apex_gpu or APEX_GPUS.get(base.name)
    if gpu is None:
        raise ConfigError(
            f"no APEX GPU known for profile {base.name!r}; pass --apex-gpu (a folder of "
            f"profile/comm, e.g. H100-SXM-80GB) or a profile of {', '.join(APEX_GPUS)}"
        )
    collectives = read_apex(args.from_apex, gpu)
    fitted, sources = fit_from_apex(base, collectives, args.from_apex, gpu, args.apex_commit)
    fitted = fitted.with_fitted(sources={**base.sources, **sources})
    write_profile(fitted, args.out, sources["interconnect"])
    for text in sources.values():
        print(text)
    print(f"wrote {args.out}")
    return 0


def from_llmservingsim(args: argparse.Namespace, base: HardwareProfile) -> int:
    """Fits `base` to LLMServingSim's measured operator times: every figure its profile
    bundles for the GPU can tell, or (v0 profiles) the attention figures."""
    from servelab.errors import ConfigError
    from servelab.lab.calibrate_llmservingsim import fit_from_llmservingsim
    from servelab.lab.llmservingsim_data import LLMSERVINGSIM_GPUS

    gpu = args.llmservingsim_gpu or LLMSERVINGSIM_GPUS.get(base.name)
    if gpu is None:
        raise ConfigError(f"no LLMServingSim GPU known for profile {base.name!r}; pass "
                          f"--llmservingsim-gpu (a folder of profiler/perf or of perf_models, "
                          f"e.g. RTXPRO6000, H100)")  # fmt: skip
    fitted, sources = fit_from_llmservingsim(base, args.from_llmservingsim, gpu,
                                             args.llmservingsim_commit, args.llmservingsim_configs,
                                             measured_bandwidth=args.measured_bandwidth)  # fmt: skip
    kept = dict(base.sources)
    if "measured" in sources:  # every compute figure fitted: the profile is measured
        kept = {k: v for k, v in kept.items() if k not in ("efficiencies", "basis")}
        fitted = fitted.with_fitted(basis="measured")
    write_profile(fitted.with_fitted(sources={**kept, **sources}), args.out, None)
    for text in sources.values():
        print(text)
    print(f"wrote {args.out}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a == "--host" or a.startswith("--host=") for a in argv):
        from servelab.lab import host_time  # the engine's own CPU time: its own options

        return host_time.main(argv)
    parser = argparse.ArgumentParser(
        prog="servelab-calibrate",
        description="fit a hardware profile to the real engine's step times on this machine, "
        "or to measured GPU operator times (--from-vidur)",
    )
    parser.add_argument("--host", type=Path, metavar="OUT.yaml",
                        help="measure a host profile instead: the engine's own CPU time per step "
                        "on this machine (options: servelab-calibrate --host X --help)")  # fmt: skip
    parser.add_argument("--profile", default="cpu-local", help="the profile to start from")
    parser.add_argument("--model", default="bench", help="the model whose forward is timed")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's)"
    )
    parser.add_argument(
        "--device", default="cpu", help="cpu, or cuda to fit a GPU profile (e.g. --profile h200)"
    )
    parser.add_argument("--out", type=Path, default=Path("cpu-local.yaml"))
    parser.add_argument("--save-steps", type=Path, help="also write the measured steps (.npz)")
    parser.add_argument(
        "--from-vidur", type=Path, metavar="DIR",
        help="fit to Vidur's profiling CSVs instead (a local copy of its data/profiling)",
    )  # fmt: skip
    parser.add_argument("--vidur-device", help="compute/<device> to read (default: by --profile)")
    parser.add_argument("--vidur-network", help="network/<node> for all-reduce (e.g. h100_dgx)")
    parser.add_argument("--vidur-commit", default="unknown",
                        help="the Vidur commit the data comes from, for the profile's sources")  # fmt: skip
    parser.add_argument(
        "--from-apex", type=Path, metavar="DIR",
        help="fit the collective figures to APEX's NCCL times (a local copy of apex_plus's "
        "profile/comm, or of the repository)",
    )  # fmt: skip
    parser.add_argument("--apex-gpu", help="profile/comm/<GPU> to read (default: by --profile)")
    parser.add_argument("--apex-commit", default="unknown",
                        help="the apex_plus commit the data comes from, for the profile's sources")  # fmt: skip
    parser.add_argument(
        "--from-llmservingsim", type=Path, metavar="DIR",
        help="fit to LLMServingSim's measured operator times (a checkout: its profile "
        "bundles, profiler/perf/<GPU>, give every compute figure; its v0 perf_models the "
        "attention figures)",
    )  # fmt: skip
    parser.add_argument("--llmservingsim-gpu",
                        help="profiler/perf/<GPU> or perf_models/<GPU> (default: by --profile)")  # fmt: skip
    parser.add_argument("--measured-bandwidth", type=float,
                        help="peak memory bandwidth (bytes/s) of the GPU the LLMServingSim data "
                        "was measured on, when not the profile's (a sibling with the same cores)")  # fmt: skip
    parser.add_argument("--llmservingsim-configs", type=Path,
                        help="the models' config.json files as <org>/<model>.json (default: "
                        "the checkout's configs/model)")  # fmt: skip
    parser.add_argument("--llmservingsim-commit", default="unknown",
                        help="the LLMServingSim commit the data comes from")  # fmt: skip
    args = parser.parse_args(argv)
    base = load_profile(args.profile)
    if args.from_llmservingsim:
        return from_llmservingsim(args, base)
    if args.from_vidur:
        return from_vidur(args, base)
    if args.from_apex:
        return from_apex(args, base)
    data = measure(args.model, args.dtype, args.repeats, args.threads, args.device)
    if args.save_steps:
        _save_steps(args.save_steps, data)
    size = 2 if args.dtype in ("bfloat16", "float16") else np.dtype(args.dtype).itemsize
    fitted = fit_profile(base, data["shape"], data["shapes"], data["seconds"], args.dtype, size)
    fitted = fitted.with_fitted(basis="measured")
    measured = np.array(data["seconds"])
    predicted = predict(fitted, data["shape"], data["shapes"], args.dtype, size)
    error = median_abs_error(predicted, measured)
    note = (
        f"servelab-calibrate on {platform.node()} ({platform.processor() or platform.machine()}), "
        f"{datetime.date.today()}: {len(measured)} steps of model {args.model} {args.dtype}, "
        f"median abs error {error:.1%}"
    )
    write_profile(fitted, args.out, note)
    for name in FIT_PARAMETERS:
        print(f"{name:>22}: {getattr(fitted, name):.4g}")
    print(f"{len(measured)} steps, median abs error {error:.1%}; wrote {args.out}")
    return 0
