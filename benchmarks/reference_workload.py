"""What every benchmark group shares: the reference workload, the parts to
benchmark (read from the registry, so a newly registered part is benchmarked
without touching this folder) and one timed run of an engine.

The reference workload is the `reference` experiment preset
(`conf/experiment/reference.yaml` + `conf/workload/reference.yaml`): the tiny
Qwen3 `bench` shape (4 layers, hidden 256, 4 query / 2 KV heads, head_dim 64,
intermediate 512, vocabulary 1024, untied, random weights seed 0), 64
requests, prompts uniform in [32, 256], outputs uniform in [16, 256] (seeded),
all at once, greedy, `ignore_eos`, float32, 2 threads. It is composed from
the preset here, so the benchmarks and `servelab experiment=reference` can
never drift apart.

`SERVELAB_BENCH_SMOKE=1` shrinks every group to a size that only checks the
suite still runs (tests/test_benchmarks_smoke.py sets it).
"""

from __future__ import annotations

import copy
import functools
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from servelab.engine.build import build_engine
from servelab.engine.engine import Engine
from servelab.lab.runner import warm_up
from servelab.lab.workload import WorkloadRequest, make_workload
from servelab.registry.plugin_manager import registered

SMOKE = os.environ.get("SERVELAB_BENCH_SMOKE", "") not in ("", "0")
NUM_THREADS = 2  # the reference machine: 2 cores; torch.set_num_threads(2) for every group

# Options a built-in part is benchmarked with (several rows where they matter);
# a part registered by a plugin runs with its defaults.
BENCH_VARIANTS: dict[str, dict[str, list[dict]]] = {
    "scheduler": {"chunked": [{"chunk_size": 128}]},
    "allocator": {"paged": [{"prefix_caching": False}, {"prefix_caching": True}]},
    # `reference` is flash_varlen's specification (a Python loop per sequence):
    # benchmark the implementations meant to be fast
    "attention": {"flash_varlen": [{"impl": "sdpa"}, {"impl": "cpu"}]},
}


def variants(kind: str) -> list[dict]:
    """Every registered part of `kind` as config nodes, in its benchmark variants."""
    nodes = []
    for name in sorted(registered(kind)):
        for options in BENCH_VARIANTS.get(kind, {}).get(name, [{}]):
            nodes.append({"name": name, **options})
    return nodes


def node_id(node: Mapping) -> str:
    """`paged,prefix_caching=True`: a readable parameter id."""
    extra = "".join(f",{k}={v}" for k, v in node.items() if k != "name")
    return f"{node['name']}{extra}"


def runs_on_this_machine(attention: Mapping) -> str | None:
    """Why an attention backend is skipped here (None: it runs). Triton kernels
    on a CPU run under the interpreter, orders of magnitude slower: they are
    benchmarked on CUDA only."""
    if attention["name"] == "triton_paged" and not torch.cuda.is_available():
        return "triton_paged runs interpreted on a CPU; benchmarked on CUDA only"
    return None


# -- the reference workload


@functools.cache
def reference_preset() -> dict[str, Any]:
    """`experiment=reference` composed by Hydra, as a plain dict."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    with initialize_config_module(config_module="servelab.conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=["experiment=reference"])
    config = OmegaConf.to_container(cfg, resolve=True)
    if SMOKE:  # a handful of short requests: the machinery, not the figures
        config["workload"].update(
            num_requests=4,
            prompt_len={"dist": "uniform", "min": 8, "max": 24},
            output_len={"dist": "uniform", "min": 2, "max": 6},
        )
    return config


def reference_config(**parts: Any) -> dict[str, Any]:
    """The preset's engine config (no workload) with `parts` replacing components
    and `engine=` options merged into the engine node."""
    preset = reference_preset()
    config = {
        k: copy.deepcopy(v)
        for k, v in preset.items()
        if k not in ("workload", "run", "report", "serve")
    }
    engine_options = parts.pop("engine", {})
    config.update(copy.deepcopy(parts))
    config["engine"].update(engine_options)
    return config


def reference_requests(vocab_size: int, max_model_len: int) -> list[WorkloadRequest]:
    return make_workload(reference_preset()["workload"], vocab_size, max_model_len)


# -- one timed run


@dataclass
class ServeResult:
    wall_s: float
    output_tokens: int
    outputs: dict[str, list[int]]  # request id -> output token ids

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.wall_s


def prepared_engine(config: Mapping) -> tuple[Engine, list[WorkloadRequest]]:
    """A built, warmed-up engine and the reference requests for it."""
    engine = build_engine(config)
    torch.set_num_threads(int(config["engine"].get("num_threads") or NUM_THREADS))
    requests = reference_requests(engine.model_config.vocab_size, engine.max_model_len)
    warm_up(engine)
    return engine, requests


def serve_all(engine: Engine, requests: list[WorkloadRequest]) -> ServeResult:
    """Adds every request at once and steps to the end; the clock covers
    exactly that (the reference workload arrives all at once)."""
    start = time.perf_counter()
    for i, req in enumerate(requests):
        engine.add_request(req.prompt_token_ids, req.params, request_id=req.request_id or str(i))
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] = out.token_ids
    wall = time.perf_counter() - start
    return ServeResult(wall, sum(len(t) for t in outputs.values()), outputs)
