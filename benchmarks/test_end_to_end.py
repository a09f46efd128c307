"""End to end: output tok/s of the engine on the reference workload, for every
scheduler x allocator x attention combination in the registry (one timed run
each: the workload is two thirds of a minute of work at worst; warm-up and
engine construction are outside the clock).

`extra_info` carries `output_tok_s` (the figure to compare), `steps` and the
output digest (equal digests: equal tokens, whatever the combination).
"""

from __future__ import annotations

import hashlib
import json

import pytest
from reference_workload import (
    SMOKE,
    node_id,
    prepared_engine,
    reference_config,
    runs_on_this_machine,
    serve_all,
    variants,
)

ROUNDS = 1


def combinations() -> list[dict]:
    combos = []
    for scheduler in variants("scheduler"):
        for allocator in variants("allocator"):
            for attention in variants("attention"):
                combos.append(dict(scheduler=scheduler, allocator=allocator, attention=attention))
    if SMOKE:  # one row per part is enough to know the machinery runs
        combos = [c for i, c in enumerate(combos) if i % 5 == 0]
    return combos


def combo_id(combo: dict) -> str:
    return "|".join(node_id(node) for node in combo.values())


def digest(outputs: dict[str, list[int]]) -> str:
    text = json.dumps(sorted(outputs.items()), separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


@pytest.mark.benchmark(group="end to end: reference workload")
@pytest.mark.parametrize("combo", combinations(), ids=combo_id)
def test_reference_workload(benchmark, combo):
    reason = runs_on_this_machine(combo["attention"])
    if reason:
        pytest.skip(reason)
    config = reference_config(**combo)

    def setup():
        return prepared_engine(config), {}

    results = []

    def run(engine, requests):
        results.append(serve_all(engine, requests))

    benchmark.pedantic(run, setup=setup, rounds=ROUNDS, iterations=1)
    result = results[-1]
    assert result.outputs and all(result.outputs.values())
    benchmark.extra_info.update(
        output_tok_s=round(result.output_tok_s, 1),
        output_tokens=result.output_tokens,
        output_digest=digest(result.outputs),
    )
