"""Every built-in scheduler (and the example `sjf`) makes the same decisions,
step for step, as it did before the schedulers were rewritten on the policy
hooks (`servelab.scheduling`).

Each case serves fixed workloads on the simulated executor (stand-in tokens,
so it runs in seconds) and fingerprints every counted field of every
`StepRecord` plus the order requests finished in and their preemptions. The
expected fingerprints in `same_decisions.json` were written by this module
(`python -m tests.engine.test_same_decisions --write`) on the code before the
rewrite; a change to them is a change of behaviour and needs a reason.
"""

from __future__ import annotations

import hashlib
import json
import sys
from contextlib import ExitStack
from pathlib import Path

import pytest

from servelab.step.sequence import SamplingParams
from servelab.testing.conformance import temporarily_registered
from servelab.testing.decisions import COUNTED, ENGINE, workload

GOLDEN = Path(__file__).with_name("same_decisions.json")
SJF_SRC = Path(__file__).parents[2] / "examples" / "servelab-sjf" / "src"

SCHEDULERS = {
    "static-reserve": {"name": "static", "admission": "reserve"},
    "static-batch3": {"name": "static", "batch_size": 3},
    "continuous": {"name": "continuous"},
    "continuous-lpm": {"name": "continuous", "order": "lpm"},
    "continuous-reserve": {"name": "continuous", "admission": "reserve"},
    "chunked": {"name": "chunked", "chunk_size": 8},
    "mlfq": {
        "name": "mlfq",
        "base_quantum": 2,
        "prompt_tokens_per_step": 8,
        "starvation_steps": 16,
    },
    "mlfq-default": {"name": "mlfq"},
    "vtc": {"name": "vtc"},
    "vtc-lpm": {"name": "vtc", "order": "lpm", "w_output": 1.0},
    "sjf": {"name": "sjf"},
    "sjf-total": {"name": "sjf", "predictor": "total", "ageing": 0.0},
}
PARTS = {
    "paged-recompute": {"allocator": {"name": "paged", "block_size": 4}, "preemption": "recompute"},
    "prefix-swap": {
        "allocator": {"name": "paged", "block_size": 4, "prefix_caching": True},
        "preemption": "swap",
    },
    "radix-recompute": {"allocator": {"name": "radix", "page_size": 1}, "preemption": "recompute"},
}
CASES = [f"{s}/{p}/{w}" for s in SCHEDULERS for p in PARTS for w in ("single", "forks")]


def requests(kind: str) -> list[tuple[list[int], SamplingParams, int]]:
    """`decisions.workload`; "forks" also asks for two samples on every third
    request and gives every fourth a higher priority."""
    out = []
    for i, (prompt, params) in enumerate(workload(seed=0 if kind == "single" else 1)):
        priority = 0
        if kind == "forks":
            if i % 3 == 1:
                params = SamplingParams(
                    temperature=0.0, max_tokens=params.max_tokens, ignore_eos=True, n=2
                )
            priority = -1 if i % 4 == 2 else 0
        out.append((prompt, params, priority))
    return out


def sjf_class() -> type:
    if str(SJF_SRC) not in sys.path:
        sys.path.insert(0, str(SJF_SRC))
    from servelab_sjf import ShortestJobFirst

    return ShortestJobFirst


def fingerprint(case: str) -> dict:
    """Steps, a hash of every counted field of every step, and the requests in
    the order they finished (with their finish step and preemptions)."""
    from servelab.llm import LLM

    scheduler, parts, kind = case.split("/")
    node = dict(SCHEDULERS[scheduler])
    with ExitStack() as stack:
        if node["name"] == "sjf":
            node["name"] = stack.enter_context(temporarily_registered("scheduler", sjf_class()))
        llm = LLM(model="tiny", scheduler=node, **PARTS[parts], executor="simulated", **ENGINE)
        engine = llm.engine
        work = requests(kind)
        for i, (prompt, params, priority) in enumerate(work):
            engine.add_request(prompt, params, f"r{i}", priority=priority, client=f"c{i % 3}")
        bound = 50 * sum(len(p) + sp.max_tokens * sp.n for p, sp, _ in work) + 100
        while engine.has_unfinished():
            engine.step()
            assert len(engine.metrics.steps) <= bound, "the run does not end"
    rows = [[getattr(s, k) for k in COUNTED] for s in engine.metrics.steps]
    finished = [
        [r.request_id, r.finished_step, r.preemptions, r.output_tokens, r.finish_reason]
        for r in engine.metrics.requests
    ]
    digest = hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16]
    return {"steps": len(rows), "rows": digest, "finished": finished}


@pytest.mark.parametrize("case", CASES)
def test_every_builtin_decides_as_before(case):
    want = json.loads(GOLDEN.read_text())[case]
    got = fingerprint(case)
    assert got["finished"] == want["finished"]
    assert (got["steps"], got["rows"]) == (want["steps"], want["rows"])


def test_the_cases_preempt_swap_and_fork():
    """The golden runs are tight enough that the decisions compared are not trivial."""
    golden = json.loads(GOLDEN.read_text())
    assert set(golden) == set(CASES)
    assert any(max(r[2] for r in g["finished"]) > 0 for g in golden.values())
    forks = [g for c, g in golden.items() if c.endswith("/forks")]
    assert all(sum(r[3] for r in g["finished"]) > 0 for g in forks)


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    lines = [f"{json.dumps(c)}: {json.dumps(fingerprint(c))}" for c in CASES]
    GOLDEN.write_text("{\n" + ",\n".join(lines) + "\n}\n")
