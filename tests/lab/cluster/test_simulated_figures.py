"""The simulated executor's figures do not move when its code gets faster.

Each case serves a fixed Poisson workload of Llama-3-8B on the `h100-sxm` profile (a
cluster behind least-load routing, or one engine under KV pressure with preemption,
chunked prefill, prefix caching, tensor parallelism or the padded backend) and
fingerprints, bit for bit, every field of every `RequestRecord` (arrival, TTFT, each
token's time and step, finish, preemptions) and of every `StepRecord` (start, simulated
time, counts), with the summary's step count and the output digest. The expected values
in `simulated_figures.json` were written by this module
(`python -m tests.lab.cluster.test_simulated_figures --write`) on the code before the
simulated path was optimised; a change to them is a change of what is simulated and needs
a reason.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from servelab.engine.metrics import RequestRecord, StepRecord
from servelab.lab.cluster.run import run_cluster
from servelab.lab.runner import run_config

GOLDEN = Path(__file__).with_name("simulated_figures.json")
WORKLOAD = {"name": "synthetic", "num_requests": 96, "seed": 3, "arrival": "poisson",
            "rate": 60.0, "prompt_len": {"dist": "uniform", "min": 16, "max": 600},
            "output_len": {"dist": "uniform", "min": 1, "max": 96},
            "shared_prefix_len": 64, "shared_fraction": 0.5}  # fmt: skip
BASE = {"model": "llama3-8b", "executor": "simulated", "hardware": "h100-sxm",
        "workload": WORKLOAD, "run": {"warmup": False, "progress": False}}  # fmt: skip
# ~2,000 tokens of KV per GPU (128 KiB a token): requests are preempted
TIGHT = {"max_model_len": 1024, "kv_cache_memory": "256MiB", "max_num_seqs": 32,
         "swap_space": "128MiB", "max_num_batched_tokens": 1024}  # fmt: skip
CASES = {
    "cluster-least-load": {
        "router": "least_load",
        "cluster": {"replicas": 4},
        "engine": {"gpu_memory_utilization": 0.9, "max_num_seqs": 16},
    },
    "tight-recompute": {"engine": TIGHT, "preemption": "recompute"},
    "tight-swap-prefix-chunked": {
        "engine": TIGHT,
        "preemption": "swap",
        "scheduler": {"name": "chunked", "chunk_size": 256},
        "allocator": {"name": "paged", "block_size": 16, "prefix_caching": True},
    },
    "all-at-once-96-rows": {  # decode batches wide enough for the executor's array path
        "engine": {"gpu_memory_utilization": 0.9, "max_num_seqs": 256},
        "workload": {**WORKLOAD, "arrival": "all_at_once"},
    },
    "tp2-padded": {
        "engine": {**TIGHT, "tensor_parallel_size": 2, "kv_cache_memory": "512MiB"},
        "attention": "padded",
    },
}


def fingerprint(case: str) -> dict:
    config = {**BASE, **CASES[case]}
    if "cluster" in config:
        result = run_cluster(config)
        requests, steps = result.requests, result.steps
    else:
        result = run_config(config)
        requests, steps = result.requests, result.steps
    return {
        "steps": int(result.summary["steps"]),
        "requests": int(result.summary["requests"]),
        "preemptions": int(result.summary["preemptions"]),
        "output_digest": result.summary["output_digest"],
        "request_rows": digest(sorted(requests, key=lambda r: r.request_id), RequestRecord),
        "step_rows": digest(sorted(steps, key=lambda s: (s.start_time, s.step)), StepRecord),
    }


# fields added after the golden values, zero in runs without a proposer: left out when
# zero, so the digests show nothing else moved
SPECULATIVE_FIELDS = frozenset({"drafted_tokens", "accepted_tokens", "verifications"})


def digest(records: list, kind: type) -> str:
    """A hash of every field of every record, floats to the last bit (`float.hex`)."""
    h = hashlib.sha256()
    for record in records:
        for f in fields(kind):
            if f.name in SPECULATIVE_FIELDS and getattr(record, f.name) == 0:
                continue
            h.update(f"{f.name}={exact(getattr(record, f.name))};".encode())
    return h.hexdigest()[:16]


def exact(value) -> str:
    if isinstance(value, float):
        return value.hex()
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(exact(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{exact(v)}" for k, v in sorted(value.items())) + "}"
    return repr(value)


@pytest.mark.parametrize("case", list(CASES))
def test_simulated_figures_are_unchanged(case):
    expected = json.loads(GOLDEN.read_text())[case]
    assert fingerprint(case) == expected


def test_the_cases_preempt_swap_and_hit_the_prefix_cache():
    """The tight cases exercise what they are there for."""
    golden = json.loads(GOLDEN.read_text())
    assert golden["tight-recompute"]["preemptions"] > 0
    assert golden["tight-swap-prefix-chunked"]["preemptions"] > 0
    assert all(g["requests"] == WORKLOAD["num_requests"] for g in golden.values())


if __name__ == "__main__" and "--write" in sys.argv:
    written = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
    for c in sys.argv[sys.argv.index("--write") + 1 :] or CASES:  # some cases, or every one
        written[c] = fingerprint(c)
    GOLDEN.write_text(json.dumps({c: written[c] for c in CASES}, indent=1) + "\n")
