"""KV allocators: bookkeeping throughput with 10k sequences.

Each benchmark times one operation over every sequence (allocate a prompt,
append one token, free, fork, match a cached prefix); `extra_info["us_per_op"]`
is the time per sequence. Pure CPU bookkeeping: no tensors, no model.
"""

from __future__ import annotations

import random

import pytest
from reference_workload import SMOKE, node_id, variants

from servelab.registry.construct import construct
from servelab.step.sequence import SamplingParams, Sequence

NUM_SEQS = 200 if SMOKE else 10_000
PROMPT_LEN = 64  # four 16-token blocks
SHARED_PREFIX = 48  # three full blocks every prefix-match sequence shares
MAX_MODEL_LEN = 128
ROUNDS = 1 if SMOKE else 5
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_MODEL_LEN - PROMPT_LEN)

ALLOCATORS = variants("allocator")


def make_allocator(node: dict):
    return construct(
        "allocator",
        node,
        token_capacity=2 * NUM_SEQS * MAX_MODEL_LEN,  # room for every sequence and its fork
        host_token_capacity=0,
        max_model_len=MAX_MODEL_LEN,
    )


def make_seqs(prefix: list[int] | None = None) -> list[Sequence]:
    rng = random.Random(0)
    prefix = prefix or []
    return [
        Sequence(
            str(i),
            prefix + [rng.randrange(2, 1024) for _ in range(PROMPT_LEN - len(prefix))],
            PARAMS,
        )
        for i in range(NUM_SEQS)
    ]


def allocate_all(allocator, seqs: list[Sequence]) -> None:
    """Admission as the scheduler does it: room for the prompt, then computed."""
    for seq in seqs:
        allocator.allocate(seq, seq.num_tokens)
        seq.num_computed_tokens = seq.num_tokens
        allocator.commit(seq)


def record(benchmark, op: str) -> None:
    benchmark.extra_info.update(op=op, num_seqs=NUM_SEQS)
    stats = getattr(benchmark, "stats", None)
    if stats is not None:  # None under --benchmark-disable
        benchmark.extra_info["us_per_op"] = stats.stats.median / NUM_SEQS * 1e6


@pytest.mark.benchmark(group="allocator: allocate")
@pytest.mark.parametrize("node", ALLOCATORS, ids=node_id)
def test_allocate(benchmark, node):
    def setup():
        return (make_allocator(node), make_seqs()), {}

    def run(allocator, seqs):
        for seq in seqs:
            allocator.allocate(seq, seq.num_tokens)

    benchmark.pedantic(run, setup=setup, rounds=ROUNDS, iterations=1)
    record(benchmark, "allocate")


@pytest.mark.benchmark(group="allocator: append")
@pytest.mark.parametrize("node", ALLOCATORS, ids=node_id)
def test_append(benchmark, node):
    """One decode token per sequence: room for it, then computed and committed."""

    def setup():
        allocator, seqs = make_allocator(node), make_seqs()
        allocate_all(allocator, seqs)
        for seq in seqs:
            seq.append_token(7)
        return (allocator, seqs), {}

    def run(allocator, seqs):
        for seq in seqs:
            allocator.allocate(seq, seq.num_tokens)
            seq.num_computed_tokens = seq.num_tokens
            allocator.commit(seq)

    benchmark.pedantic(run, setup=setup, rounds=ROUNDS, iterations=1)
    record(benchmark, "append")


@pytest.mark.benchmark(group="allocator: free")
@pytest.mark.parametrize("node", ALLOCATORS, ids=node_id)
def test_free(benchmark, node):
    def setup():
        allocator, seqs = make_allocator(node), make_seqs()
        allocate_all(allocator, seqs)
        return (allocator, seqs), {}

    def run(allocator, seqs):
        for seq in seqs:
            allocator.free(seq)

    benchmark.pedantic(run, setup=setup, rounds=ROUNDS, iterations=1)
    record(benchmark, "free")


@pytest.mark.benchmark(group="allocator: fork")
@pytest.mark.parametrize("node", ALLOCATORS, ids=node_id)
def test_fork(benchmark, node):
    def setup():
        allocator, seqs = make_allocator(node), make_seqs()
        allocate_all(allocator, seqs)
        children = [s.fork(1, s.params) for s in seqs]
        return (allocator, seqs, children), {}

    def run(allocator, seqs, children):
        for parent, child in zip(seqs, children):
            allocator.fork(parent, child)

    benchmark.pedantic(run, setup=setup, rounds=ROUNDS, iterations=1)
    record(benchmark, "fork")


@pytest.mark.benchmark(group="allocator: prefix match")
@pytest.mark.parametrize("node", ALLOCATORS, ids=node_id)
def test_prefix_match(benchmark, node):
    """Every sequence starts with the same 48 tokens, published by a first one."""
    prefix = [random.Random(1).randrange(2, 1024) for _ in range(SHARED_PREFIX)]

    def setup():
        allocator = make_allocator(node)
        first, *seqs = make_seqs(prefix)
        allocate_all(allocator, [first])
        return (allocator, seqs), {}

    hits = []

    def run(allocator, seqs):
        hits.append(sum(allocator.match_prefix(seq) for seq in seqs))

    benchmark.pedantic(run, setup=setup, rounds=ROUNDS, iterations=1)
    record(benchmark, "prefix_match")
    allocator = make_allocator(node)
    caches = getattr(allocator, "prefix_caching", False)
    # the cache serves the shared whole blocks to every sequence, or nothing without it
    assert hits[-1] == ((NUM_SEQS - 1) * SHARED_PREFIX if caches else 0)
