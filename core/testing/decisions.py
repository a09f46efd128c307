"""Same decisions: an executor must not change what the scheduler, allocator and
preemption policy decide. Two engines (the real `model` executor and the one
under test) serve the same requests, all arriving at once; every counted field
of every `StepRecord` must be equal, step for step.

Decisions must not depend on token values, since the executors' tokens differ:
every request has `ignore_eos` and a fixed `max_tokens`, and one sample each
(greedy forks of the real model share their tokens, stand-ins do not, so a
prefix cache would see different generated text). Not compared: the clock
(`start_time`, `wall_time`) and the attention backend's own counters (padding,
key slots), which only a real forward produces.
"""

from __future__ import annotations

import random
from dataclasses import fields
from typing import Any

from servelab.engine.metrics import StepRecord
from servelab.step.sequence import SamplingParams

NOT_COUNTED = frozenset(
    {"start_time", "wall_time", "extra", "padding_tokens", "padded_key_slots", "real_key_tokens"}
)
COUNTED = tuple(f.name for f in fields(StepRecord) if f.name not in NOT_COUNTED)

TINY_KV_BYTES_PER_TOKEN = 1024  # the `tiny` shape in float64: 2 x 2 layers x 2 heads x 16 x 8
ENGINE = dict(
    dtype="float64",
    max_model_len=64,
    max_num_batched_tokens=64,
    kv_cache_memory=128 * TINY_KV_BYTES_PER_TOKEN,  # tight: on-demand admission preempts
    swap_space=96 * TINY_KV_BYTES_PER_TOKEN,
    max_num_seqs=8,
    num_threads=1,
)


def workload(seed: int = 0, num_requests: int = 12) -> list[tuple[list[int], SamplingParams]]:
    """Mixed prompt lengths (two share a long prefix) and output lengths."""
    rng = random.Random(seed)
    shared = [rng.randrange(4, 500) for _ in range(21)]
    out = []
    for i in range(num_requests):
        length = rng.choice([1, 2, 5, 13, 30])
        prompt = [rng.randrange(4, 500) for _ in range(length)]
        if i % 4 == 3:
            prompt = shared + prompt[:3]
        params = SamplingParams(
            temperature=0.0, max_tokens=rng.choice([1, 4, 12, 24]), ignore_eos=True
        )
        out.append((prompt, params))
    return out


def step_rows(combo: dict, executor: Any, requests, **engine: Any) -> list[dict]:
    """The counted fields of every step of one engine serving `requests` at once."""
    from servelab.llm import LLM

    llm = LLM(model="tiny", **combo, executor=executor, **{**ENGINE, **engine})
    eng = llm.engine
    for i, (prompt, params) in enumerate(requests):
        eng.add_request(prompt, params, request_id=f"r{i}", client=f"client-{i % 3}")
    bound = 50 * sum(len(p) + sp.max_tokens for p, sp in requests) + 100
    while eng.has_unfinished():
        eng.step()
        assert len(eng.metrics.steps) <= bound, "the run does not end"
    return [{k: getattr(s, k) for k in COUNTED} for s in eng.metrics.steps]


def assert_same_decisions(
    combo: dict, executor: Any, reference: Any = "model", seed: int = 0, **engine: Any
) -> int:
    """Runs `combo` under both executors; AssertionError at the first step that
    differs, naming the fields. Returns the number of steps compared."""
    requests = workload(seed)
    want = step_rows(combo, reference, requests, **engine)
    got = step_rows(combo, executor, requests, **engine)
    for i, (a, b) in enumerate(zip(want, got)):
        diff = {k: (a[k], b[k]) for k in COUNTED if a[k] != b[k]}
        assert not diff, f"step {i}: {reference} vs {executor} differ in {diff}"
    assert len(want) == len(got), f"{len(want)} steps with {reference}, {len(got)} with {executor}"
    return len(want)
