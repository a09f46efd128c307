"""Scheduler overhead: the CPU time of one decode step's bookkeeping with 256
running sequences — `schedule()`, the step's input preparation (token ids,
`AttentionMetadata`, sampling rows: `ModelRunner.prepare`) and `update()` —
with a stub model that samples a fixed token, per scheduler x allocator.

The figure to watch: continuous + paged + prefix caching, per step (target
<= 200 us on the reference machine).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from reference_workload import SMOKE, node_id, variants

from servelab.executor.model_runner import ModelRunner
from servelab.registry.construct import construct
from servelab.scheduling import SchedulerCore
from servelab.step.metadata import AttentionMetadata
from servelab.step.plan import SampledTokens
from servelab.step.sequence import SamplingParams, Sequence, SequenceGroup

NUM_SEQS = 16 if SMOKE else 256
PROMPT_LEN = 32
MAX_MODEL_LEN = 4096
BLOCK_TOKENS = NUM_SEQS * MAX_MODEL_LEN  # bookkeeping only: no KV tensors exist
ROUNDS = 3 if SMOKE else 300  # measured steps (each appends one token to every sequence)


class StubBackend:
    """The attention backend's per-step plan is its own cost: not counted here."""

    def plan(self, meta: AttentionMetadata) -> AttentionMetadata:
        return meta


class StubKVCache:
    layers: list = []


def running_scheduler(scheduler_node: dict, allocator_node: dict):
    """A scheduler whose NUM_SEQS sequences have all finished their prompts."""
    allocator = construct(
        "allocator",
        allocator_node,
        token_capacity=BLOCK_TOKENS,
        host_token_capacity=0,
        max_model_len=MAX_MODEL_LEN,
    )
    scheduler = SchedulerCore(
        construct("scheduler", scheduler_node),
        allocator=allocator,
        preemption=construct("preemption", "recompute"),
        max_num_seqs=NUM_SEQS,
        max_num_batched_tokens=max(NUM_SEQS * PROMPT_LEN, MAX_MODEL_LEN),
        max_model_len=MAX_MODEL_LEN,
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_MODEL_LEN - PROMPT_LEN, ignore_eos=True)
    for i in range(NUM_SEQS):
        prompt = [2 + (i * 31 + j) % 1000 for j in range(PROMPT_LEN)]
        scheduler.add(SequenceGroup(str(i), Sequence(str(i), prompt, params)))
    runner = ModelRunner(
        model_forward=None,
        backend=StubBackend(),
        kv_cache=StubKVCache(),
        allocator=allocator,
        sampler=None,
        device=torch.device("cpu"),
    )
    step = decode_step(scheduler, runner)
    while sum(len(g.seqs) for g in scheduler.running) < NUM_SEQS or any(
        not s.is_decoding for g in scheduler.running for s in g.seqs
    ):
        step()  # prefill every prompt (chunked: over several steps)
    return scheduler, step


def decode_step(scheduler, runner: ModelRunner):
    clock = itertools.count()

    def step() -> int:
        plan = scheduler.schedule()
        batch = runner.prepare(plan)
        owners = batch.sample_owners
        sampled = SampledTokens(owners, [5] * len(owners))  # the stub model's token
        scheduler.update(plan, sampled, float(next(clock)))
        return len(plan.seqs)  # sequences in the step

    return step


SCHEDULERS = variants("scheduler")
ALLOCATORS = variants("allocator")


@pytest.mark.benchmark(group="scheduler overhead: one decode step, 256 running")
@pytest.mark.parametrize("allocator", ALLOCATORS, ids=node_id)
@pytest.mark.parametrize("scheduler", SCHEDULERS, ids=node_id)
def test_step_overhead(benchmark, scheduler, allocator):
    _, step = running_scheduler(scheduler, allocator)
    scheduled = benchmark.pedantic(step, rounds=ROUNDS, iterations=1, warmup_rounds=2)
    assert scheduled == NUM_SEQS  # every sequence decoded in the step measured
    benchmark.extra_info["running_seqs"] = NUM_SEQS
    stats = getattr(benchmark, "stats", None)
    if stats is not None:
        benchmark.extra_info["us_per_step"] = stats.stats.median * 1e6
