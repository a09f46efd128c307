"""Measured serving runs of a real engine (vLLM), as what a replay needs: each request's
arrival, prompt and output lengths and its measured latencies, and the engine's
settings. Nothing is downloaded; the readers take local copies. Two published formats:

- **inference-sim** (github.com/inference-sim/inference-sim, Apache-2.0; its
  `eval/ground_truth/<run>/` at commit e7a4aa3): `exp-config.yaml` (model, tensor
  parallelism, max_model_len, max_num_batched_tokens, max_num_seqs), `profile.yaml`
  (GuideLLM's workload: `data.prefix_tokens` tokens every prompt shares), `traces.json`
  (OpenTelemetry spans, one JSON document a line: a span `llm_request` per request,
  starting at its arrival, with `gen_ai.latency.time_to_first_token`, `.e2e`,
  `gen_ai.usage.prompt_tokens`, `.completion_tokens`), `vllm.log` (vLLM's log: its
  version, `GPU KV cache size: N tokens`, whether prefix caching was on). The model's
  shape: the repository's `model_configs/<name>/config.json`.
- **LLMServingSim** (github.com/casys-kaist/LLMServingSim, MIT): its
  `bench/examples/<GPU>/<model>/vllm/`: `meta.json` (model, vLLM version, the engine's
  arguments) and `requests.jsonl` (per request `input_toks`, `output_toks` and vLLM's
  `queued_ts`, `first_token_ts`, `last_token_ts`, one monotonic clock). The model's
  shape: the checkout's `configs/model/<org>/<model>.json`.

Per request: TTFT from arrival (inference-sim: the span's start; LLMServingSim: queued)
to the first token, E2E to the last, TPOT = (E2E - TTFT) / (output tokens - 1).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from servelab.errors import ConfigError


@dataclass
class MeasuredRun:
    """One measured serving run: the engine's settings and its requests (arrays in
    arrival order; arrival in seconds from the first)."""

    name: str
    source: str
    gpu: str
    model: str
    model_config: Path
    tensor_parallel: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int | None
    prefix_caching: bool
    shared_prefix: int  # tokens at the start of every prompt that are the same
    kv_cache_tokens: int | None  # the engine's KV capacity where its log says it
    vllm_version: str
    arrival: np.ndarray
    prompt: np.ndarray
    output: np.ndarray
    ttft: np.ndarray
    e2e: np.ndarray
    notes: list[str] = field(default_factory=list)
    # vLLM's async scheduling (the host prepares step n + 1 while the device runs step n):
    # replayed with the simulated executor's `overlap`
    async_scheduling: bool = False

    @property
    def tpot(self) -> np.ndarray:
        """Seconds per output token after the first (NaN for one-token outputs)."""
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(self.output > 1, (self.e2e - self.ttft) / (self.output - 1), np.nan)


def _yaml(path: Path) -> dict:
    import yaml

    return yaml.safe_load(path.read_text()) or {}


def _spans(path: Path) -> list[tuple[float, dict]]:
    """(start seconds, attributes) of every `llm_request` span of an OTLP JSON-lines file."""
    out = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        for resource in json.loads(line).get("resourceSpans", []):
            for scope in resource.get("scopeSpans", []):
                for span in scope.get("spans", []):
                    if span.get("name") != "llm_request":
                        continue
                    values = {a["key"]: next(iter(a["value"].values())) for a in span["attributes"]}
                    out.append((int(span["startTimeUnixNano"]) / 1e9, values))
    return sorted(out, key=lambda s: s[0])


def read_inference_sim(run: Path, model_configs: Path) -> MeasuredRun:
    """One inference-sim ground-truth run folder; `model_configs` holds
    `<name>/config.json` (the repository's model_configs)."""
    run = Path(run)
    config = _yaml(run / "exp-config.yaml")
    profile = _yaml(run / "profile.yaml") if (run / "profile.yaml").is_file() else {}
    log = (run / "vllm.log").read_text() if (run / "vllm.log").is_file() else ""
    spans = _spans(run / "traces.json")
    if not spans:
        raise ConfigError(f"no llm_request spans in {run / 'traces.json'}")
    model = str(config["model"])
    folder = Path(model_configs) / model.split("/")[-1].lower()
    if not (folder / "config.json").is_file():
        raise ConfigError(f"no config.json for {model} at {folder} (inference-sim's model_configs)")
    kv = re.findall(r"GPU KV cache size: ([\d,]+) tokens", log)
    version = re.findall(r"vLLM API server version (\S+)", log)
    caching = re.findall(r"enable_prefix_caching=(True|False)", log)
    engine = re.findall(r"max_seq_len=(\d+)", log)
    start = spans[0][0]
    attr = [a for _, a in spans]
    notes = []
    if engine and int(engine[-1]) != int(config.get("max_model_len") or 0):
        notes.append(f"exp-config says max_model_len {config.get('max_model_len')}, "
                     f"the engine ran with {engine[-1]} (the log's; used)")  # fmt: skip
    return MeasuredRun(
        name=run.name,
        source="inference-sim",
        gpu="H100",  # the collection cluster's GPUs (training/trainval_data/README.md)
        model=model,
        model_config=folder / "config.json",
        tensor_parallel=int(config.get("tensor_parallelism") or 1),
        max_num_seqs=int(config["max_num_seqs"]),
        max_num_batched_tokens=int(config["max_num_batched_tokens"]),
        max_model_len=int(engine[-1]) if engine else config.get("max_model_len"),
        prefix_caching=(caching[-1] == "True") if caching else True,
        shared_prefix=int((profile.get("data") or {}).get("prefix_tokens") or 0),
        kv_cache_tokens=int(kv[-1].replace(",", "")) if kv else None,
        vllm_version=version[-1] if version else "unknown",
        arrival=np.array([t - start for t, _ in spans]),
        prompt=np.array([int(a["gen_ai.usage.prompt_tokens"]) for a in attr]),
        output=np.array([int(a["gen_ai.usage.completion_tokens"]) for a in attr]),
        ttft=np.array([float(a["gen_ai.latency.time_to_first_token"]) for a in attr]),
        e2e=np.array([float(a["gen_ai.latency.e2e"]) for a in attr]),
        notes=notes,
        # off by default in vLLM 0.11; the log's non-default args say when it was asked for
        async_scheduling="'async_scheduling': True" in log,
    )


def read_llmservingsim_bench(folder: Path, model_configs: Path) -> MeasuredRun:
    """One LLMServingSim `bench/examples/<GPU>/<model>/` folder (its `vllm/`);
    `model_configs` holds `<org>/<model>.json`."""
    folder = Path(folder)
    meta = json.loads((folder / "vllm" / "meta.json").read_text())
    rows = [json.loads(line) for line in (folder / "vllm" / "requests.jsonl").read_text().splitlines()
            if line.strip()]  # fmt: skip
    rows.sort(key=lambda r: r["queued_ts"])
    model = str(meta["model"])
    config = Path(model_configs) / f"{model}.json"
    if not config.is_file():
        raise ConfigError(f"no config for {model} at {config} (LLMServingSim's configs/model)")
    kwargs = meta.get("engine_kwargs", {})
    version = str(meta.get("vllm_version", "unknown"))
    resolved = ((meta.get("resolved_config") or {}).get("scheduler_config") or {})
    overlap = resolved.get("async_scheduling", kwargs.get("async_scheduling"))
    notes = []
    if overlap is None:  # not recorded: the version's default, where it is known
        overlap = version_at_least(version, ASYNC_SCHEDULING_DEFAULT)
        notes.append(f"async scheduling not recorded: vLLM {version}'s default taken "
                     f"({'on' if overlap else 'off'})")  # fmt: skip
    queued = np.array([r["queued_ts"] for r in rows])
    first = np.array([r["first_token_ts"] for r in rows])
    last = np.array([r["last_token_ts"] for r in rows])
    return MeasuredRun(
        name=f"{folder.parent.name}/{folder.name}",
        source="LLMServingSim",
        gpu=folder.parent.name,
        model=model,
        model_config=config,
        tensor_parallel=int(kwargs.get("tensor_parallel_size") or 1),
        max_num_seqs=int(kwargs.get("max_num_seqs") or 256),
        max_num_batched_tokens=int(kwargs.get("max_num_batched_tokens") or 2048),
        max_model_len=kwargs.get("max_model_len"),
        prefix_caching=bool(kwargs.get("enable_prefix_caching", True)),
        shared_prefix=0,
        kv_cache_tokens=None,
        vllm_version=version,
        arrival=queued - queued[0],
        prompt=np.array([int(r["input_toks"]) for r in rows]),
        output=np.array([int(r["output_toks"]) for r in rows]),
        ttft=first - queued,
        e2e=last - queued,
        notes=notes,
        async_scheduling=bool(overlap),
    )


# the first vLLM version whose default async scheduling this data records (LLMServingSim's
# RTX 4090 run of vLLM 0.19.0 resolves it to true); earlier ones are taken as off
ASYNC_SCHEDULING_DEFAULT = (0, 19)


def version_at_least(version: str, first: tuple[int, int]) -> bool:
    parts = re.findall(r"\d+", version)[:2]
    return len(parts) == 2 and (int(parts[0]), int(parts[1])) >= first


def find_runs(root: Path, model_configs: Path | None = None) -> list[MeasuredRun]:
    """Every measured run under `root`: inference-sim run folders (exp-config.yaml and
    traces.json; model configs from `model_configs`, else the checkout's
    model_configs) and LLMServingSim bench folders (vllm/requests.jsonl; configs from
    `model_configs`, else the checkout's configs/model)."""
    root = Path(root)
    runs = []
    for exp in sorted(root.rglob("exp-config.yaml")):
        if (exp.parent / "traces.json").is_file():
            configs = model_configs or _above(exp.parent, "model_configs")
            runs.append(read_inference_sim(exp.parent, configs))
    for requests in sorted(root.rglob("vllm/requests.jsonl")):
        configs = model_configs or _above(requests.parent, "configs/model")
        runs.append(read_llmservingsim_bench(requests.parent.parent, configs))
    if not runs:
        raise ConfigError(f"no measured runs under {root} (inference-sim's eval/ground_truth/<run>/ "
                          f"or LLMServingSim's bench/examples/<GPU>/<model>/vllm/)")  # fmt: skip
    return runs


def _above(folder: Path, name: str) -> Path:
    """`name` in `folder` or the nearest folder above it that has it."""
    for parent in (folder, *folder.parents):
        if (parent / name).is_dir():
            return parent / name
    return folder / name


# the GPUs of the measured runs -> servelab's profiles
PROFILES = {"H100": "h100-sxm", "RTXPRO6000": "rtx-pro-6000"}


def unsupported(run: MeasuredRun) -> str | None:
    """Why the simulator cannot replay `run`, or None."""
    config = json.loads(Path(run.model_config).read_text())
    if config.get("num_experts") or config.get("num_local_experts"):
        return "a mixture-of-experts model (servelab's cost model has dense layers only)"
    if run.gpu not in PROFILES:
        return f"no profile for its GPU ({run.gpu})"
    return None


def write_trace(run: MeasuredRun, path: Path, vocab_size: int, seed: int = 0) -> None:
    """The run's requests as a servelab trace: each at its arrival with its lengths; with a
    shared prefix, prompts as token ids whose first `shared_prefix` are the same in all
    (the rest drawn apart, so only the prefix is shared)."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(0, vocab_size, run.shared_prefix).tolist()
    with open(path, "w") as f:
        for arrival, prompt, output in zip(run.arrival, run.prompt, run.output):
            line: dict = {"arrival_time": float(arrival), "output_len": int(output)}
            if run.shared_prefix:
                shared = prefix[: min(run.shared_prefix, int(prompt) - 1)]
                rest = rng.integers(0, vocab_size, int(prompt) - len(shared)).tolist()
                line["prompt_token_ids"] = shared + rest
            else:
                line["prompt_len"] = int(prompt)
            f.write(json.dumps(line) + "\n")


def replay_config(run: MeasuredRun, folder: Path, hardware: str | None = None,
                  overrides: dict | None = None) -> dict:  # fmt: skip
    """The servelab config that replays `run` through the simulated executor: its model's
    shape, the run's engine settings as servelab's chunked scheduler and paged allocator
    read them (vLLM's V1 scheduler: decodes first, then prompt chunks within
    max_num_batched_tokens, no cap per sequence; 16-token blocks, hashed prefix caching
    as the run had it), its KV capacity where the log gives it (else 90% of the GPU), the
    simulated executor's `overlap` where the run had vLLM's async scheduling, and its
    requests as a trace (ignore_eos: each runs to its measured output length)."""
    from servelab.model.loader import read_config

    folder = Path(folder)
    model = folder / "model"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(Path(run.model_config).read_text())
    shape = read_config(model / "config.json")
    trace = folder / "trace.jsonl"
    write_trace(run, trace, shape.vocab_size)
    longest = int(np.max(run.prompt + run.output))
    engine: dict = {
        "dtype": "bfloat16",
        "tensor_parallel_size": run.tensor_parallel,
        "max_num_seqs": run.max_num_seqs,
        "max_num_batched_tokens": run.max_num_batched_tokens,
        "max_model_len": max(int(run.max_model_len or 0), longest),
    }
    if run.kv_cache_tokens:
        per_token = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * 2  # bf16 K and V
        engine["kv_cache_memory"] = run.kv_cache_tokens * per_token
    else:
        engine["gpu_memory_utilization"] = 0.9
    config = {
        "model": str(model),
        "executor": {"name": "simulated", "overlap": run.async_scheduling},
        "hardware": hardware or PROFILES[run.gpu],
        "scheduler": {"name": "chunked", "chunk_size": run.max_num_batched_tokens},
        "allocator": {"name": "paged", "block_size": 16, "prefix_caching": run.prefix_caching},
        "preemption": "recompute",
        "engine": engine,
        "workload": {"name": "trace", "path": str(trace), "ignore_eos": True},
        "run": {"progress": False, "warmup": False},
    }
    for key, value in (overrides or {}).items():
        config[key] = {**config[key], **value} if isinstance(value, dict) else value
    return config


@dataclass
class Replay:
    """A measured run and its replay's per-request figures (arrays in the run's order)."""

    run: MeasuredRun
    hardware: str
    ttft: np.ndarray
    e2e: np.ndarray
    tpot: np.ndarray
    wall_seconds: float

    def mean_errors(self) -> dict[str, float]:
        """predicted mean / measured mean - 1 of TTFT, TPOT and E2E."""
        out = {}
        for key in ("ttft", "tpot", "e2e"):
            sim, real = getattr(self, key), getattr(self.run, key)
            out[key] = float(np.nanmean(sim) / np.nanmean(real) - 1.0)
        return out


def replay(run: MeasuredRun, folder: Path, hardware: str | None = None,
           overrides: dict | None = None) -> Replay:  # fmt: skip
    """Serves `run`'s requests through the simulated executor (`replay_config`)."""
    import time

    from servelab.lab.runner import run_config

    config = replay_config(run, folder, hardware, overrides)
    started = time.perf_counter()
    result = run_config(config)
    wall = time.perf_counter() - started
    by_id = {r.request_id: r for r in result.requests}
    # trace lines are numbered from 1 in the run's (arrival) order
    records = [by_id[f"trace-{i + 1}"] for i in range(len(run.arrival))]
    ttft = np.array([r.ttft for r in records], dtype=np.float64)
    e2e = np.array([r.finished_time - r.arrival_time for r in records])
    with np.errstate(divide="ignore", invalid="ignore"):
        tpot = np.where(run.output > 1, (e2e - ttft) / (run.output - 1), np.nan)
    label = str(config["hardware"]) + (" + overlap" if run.async_scheduling else "")
    return Replay(run, label, ttft, e2e, tpot, wall)
