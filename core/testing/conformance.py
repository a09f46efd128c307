"""The conformance checks a plugin author calls from their own test suite, e.g.
`check_scheduler(ShortestJobFirst, ageing=0.5)`.

Each check registers the class under a temporary name (a pluggy plugin added to the
process-wide plugin manager and removed afterwards) and runs it, combined with a
representative subset of the built-ins, through the token-exact oracle: every request's
tokens must equal transformers' greedy output, `check_integrity()` must hold after every
step, every request must finish exactly once and every block be free at the end; each kind
adds its own property checks. A broken rule raises AssertionError naming the combination
and what broke; a passing check returns a `ConformanceReport`. Called without options, a
check runs the part in each option set it declares (`oracle_variants`), as the oracle does.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from servelab.contracts.hookspecs import hookimpl
from servelab.contracts.kinds import KINDS
from servelab.errors import ConfigError
from servelab.registry.options import check_options, declared_variants, describe_options
from servelab.registry.plugin_manager import get_plugin_manager
from servelab.step.sequence import SamplingParams, Sequence, SequenceGroup

# The built-ins a part is combined with.
PAGED = {"name": "paged", "block_size": 4}
PAGED_PREFIX = {"name": "paged", "block_size": 4, "prefix_caching": True}
CONTIGUOUS = {"name": "contiguous"}
CONTINUOUS = {"name": "continuous", "admission": "on_demand"}
CHUNKED = {"name": "chunked", "admission": "on_demand", "chunk_size": 8}
STATIC = {"name": "static", "admission": "reserve"}
RECOMPUTE = {"name": "recompute"}
SWAP = {"name": "swap"}
PER_REQUEST = {"name": "per_request"}

TIGHT_KV_MEMORY = 96 * 1024  # 96 tokens of the oracle model's KV: on-demand runs preempt
# Two greedy samples per request, each of which must equal the reference. The
# KV budget holds three max_model_len sequences: a forked group alone always
# fits, even in the contiguous layout where the scheduler counts one spare
# copy-on-write block per group; the token budget holds both samples'
# re-prefill after a recompute preemption.
PARALLEL_SAMPLING = dict(n=2, kv_cache_memory=192 * 1024, max_num_batched_tokens=128)


@dataclass
class ConformanceReport:
    """What a passing check ran."""

    kind: str
    part: str  # module.qualname of the class under test
    combinations: list[str] = field(default_factory=list)  # oracle runs that matched
    properties: list[str] = field(default_factory=list)  # property checks that held
    skipped: list[str] = field(default_factory=list)  # combinations the part refused (ConfigError)
    preempted: int = 0  # sequences preempted over every run
    evictions: int = 0  # cached KV blocks evicted over every run (allocators with a cache)


def _each_declared_variant(
    check: Callable[..., ConformanceReport],
) -> Callable[..., ConformanceReport]:
    """A check called without options runs once for each option set the part
    declares (`oracle_variants`; its defaults when it declares none), and its
    report adds theirs up; with options, once with those."""

    @functools.wraps(check)
    def run(cls: type, **options: Any) -> ConformanceReport:
        if options:
            return check(cls, **options)
        reports = [check(cls, **declared) for declared in declared_variants(cls)]
        total = reports[0]
        for report in reports[1:]:
            total.combinations += report.combinations
            total.properties += [p for p in report.properties if p not in total.properties]
            total.skipped += report.skipped
            total.preempted += report.preempted
            total.evictions += report.evictions
        return total

    return run


# -- registering the part under test


@contextlib.contextmanager
def temporarily_registered(kind: str, cls: type, name: str | None = None) -> Iterator[str]:
    """Registers `cls` as a `kind` part on the process-wide plugin manager for
    the duration of the block; yields the name it is registered under.

    A class that does not implement its contract raises AssertionError here.
    """
    hook_name = KINDS[kind].hook
    name = name or f"under_test_{cls.__name__}"

    def provide(self) -> dict[str, type]:
        return {name: cls}

    plugin = type("ConformancePlugin", (), {hook_name: hookimpl(provide)})()
    pm = get_plugin_manager()
    plugin_name = f"servelab.testing:{kind}:{name}"
    pm.register(plugin, name=plugin_name)
    try:
        if name not in pm.registered(kind):  # checks the class against its contract now
            why = [str(e.error) for e in pm.load_errors if e.plugin == plugin_name]
            raise AssertionError(f"{cls.__qualname__} is not a valid {kind}: {'; '.join(why)}")
        yield name
    finally:
        pm.unregister(plugin)


def _node(kind: str, name: str, cls: type, options: dict[str, Any]) -> dict[str, Any]:
    """The config node of the part under test; an unknown option is the caller's ConfigError."""
    check_options(kind, name, options, describe_options(cls, kind))
    return {"name": name, **options}


def _oracle():
    # transformers is a dev dependency: imported only when a check runs
    from servelab.testing import oracle

    return oracle


def _run_oracle(
    report: ConformanceReport,
    combos: list[dict],
    *,
    refusable: bool = False,
    **drive_options: Any,
) -> None:
    """Runs each combination through the oracle; with `refusable`, a combination
    the part refuses with ConfigError (e.g. an attention backend's `check`) is
    recorded as skipped."""
    oracle = _oracle()
    case = oracle.cached_case()
    for combo in combos:
        label = oracle.combo_id(combo)
        try:
            run = oracle.drive(case, combo, **drive_options)
        except ConfigError as exc:
            if not refusable:
                raise
            report.skipped.append(f"{label}: {exc}")
            continue
        oracle.assert_matches_reference(case, combo, run)
        report.combinations.append(label)
        report.preempted += run.preempted
        report.evictions += run.evictions


def _combos(**axes: dict | list[dict]) -> list[dict]:
    """`_combos(scheduler=S, allocator=[A, B])` -> one combination per choice, in kind order."""
    oracle = _oracle()
    lists = [axes[k] if isinstance(axes[k], list) else [axes[k]] for k in oracle.KINDS]
    return [dict(zip(oracle.KINDS, choice)) for choice in itertools.product(*lists)]


# -- the checks


@_each_declared_variant
def check_scheduler(cls: type, **options: Any) -> ConformanceReport:
    """Checks a `Scheduler` (usually a `SchedulerCore` subclass) built with `options`.

    Oracle runs with the paged (plain and prefix-cached) and contiguous
    allocators under recompute and swap preemption; then the property that,
    under a KV budget tight enough to preempt, with one request aborted
    before it runs and one aborted mid-way and with parallel sampling (n=2),
    every request finishes exactly once and the others still match.
    """
    report = ConformanceReport("scheduler", _qualname(cls))
    with temporarily_registered("scheduler", cls) as name:
        node = _node("scheduler", name, cls, options)
        _run_oracle(
            report,
            _combos(
                scheduler=node,
                allocator=[PAGED, PAGED_PREFIX, CONTIGUOUS],
                preemption=[RECOMPUTE, SWAP],
                attention=PER_REQUEST,
            ),
        )
        _check_exactly_once_with_aborts(report, node)
        _run_oracle(
            report,
            _combos(scheduler=node, allocator=PAGED_PREFIX, preemption=SWAP, attention=PER_REQUEST),
            **PARALLEL_SAMPLING,
        )
        report.properties.append("parallel sampling (n=2)")
    return report


@_each_declared_variant
def check_allocator(cls: type, **options: Any) -> ConformanceReport:
    """Checks a `KVAllocator` built with `options`.

    The shadow-KV state machine (`allocator_machine`), then oracle runs under
    the continuous, chunked and static schedulers with recompute and swap
    preemption, and a parallel-sampling run (forks, copy-on-write).
    """
    from servelab.testing.allocator_machine import run_allocator_machine

    report = ConformanceReport("allocator", _qualname(cls))
    with temporarily_registered("allocator", cls) as name:
        node = _node("allocator", name, cls, options)
        run_allocator_machine(cls, options, max_examples=40, steps=25)
        report.properties.append("shadow-KV state machine")
        _run_oracle(
            report,
            _combos(
                scheduler=[CONTINUOUS, CHUNKED, STATIC],
                allocator=node,
                preemption=[RECOMPUTE, SWAP],
                attention=PER_REQUEST,
            ),
        )
        _run_oracle(
            report,
            _combos(scheduler=CONTINUOUS, allocator=node, preemption=SWAP, attention=PER_REQUEST),
            **PARALLEL_SAMPLING,
        )
        report.properties.append("parallel sampling (n=2)")
    return report


@_each_declared_variant
def check_preemption(cls: type, **options: Any) -> ConformanceReport:
    """Checks a `PreemptionPolicy` built with `options`.

    `select_victim` must return one of the groups it is offered; then oracle
    runs under the continuous and chunked schedulers (on-demand admission) and
    every built-in allocator, plus a parallel-sampling run, under a KV budget
    tight enough to preempt. At least one run must really preempt.
    """
    report = ConformanceReport("preemption", _qualname(cls))
    with temporarily_registered("preemption", cls) as name:
        node = _node("preemption", name, cls, options)
        _check_victim_is_a_candidate(cls(**options))
        report.properties.append("select_victim returns one of the running groups")
        _run_oracle(
            report,
            _combos(
                scheduler=[CONTINUOUS, CHUNKED],
                allocator=[PAGED, PAGED_PREFIX, CONTIGUOUS],
                preemption=node,
                attention=PER_REQUEST,
            ),
        )
        _run_oracle(
            report,
            _combos(scheduler=CONTINUOUS, allocator=PAGED, preemption=node, attention=PER_REQUEST),
            **PARALLEL_SAMPLING,
        )
        assert report.preempted > 0, (
            f"no run preempted, so {report.part} was never exercised; "
            "the conformance budget should have forced preemption"
        )
        report.properties.append(f"{report.preempted} preemptions, none lost a token")
    return report


@_each_declared_variant
def check_attention_backend(cls: type, **options: Any) -> ConformanceReport:
    """Checks an `AttentionBackend` built with `options`.

    Oracle runs under the continuous scheduler (whole prompts, then decodes)
    and the chunked one (prompt chunks next to decodes, chunks after a cached
    prefix) with the paged (plain and prefix-cached) and contiguous
    allocators. A combination the backend refuses in `check()` with a
    ConfigError is skipped; it must serve at least one.
    """
    report = ConformanceReport("attention", _qualname(cls))
    with temporarily_registered("attention", cls) as name:
        node = _node("attention", name, cls, options)
        _run_oracle(
            report,
            _combos(
                scheduler=[CONTINUOUS, CHUNKED],
                allocator=[PAGED, PAGED_PREFIX, CONTIGUOUS],
                preemption=RECOMPUTE,
                attention=node,
            ),
            refusable=True,
        )
        assert report.combinations, f"{report.part} refused every combination: " + "; ".join(
            report.skipped
        )
    return report


@_each_declared_variant
def check_executor(cls: type, **options: Any) -> ConformanceReport:
    """Checks an `Executor` built with `options`.

    Same decisions (`servelab.testing.decisions`): under the continuous,
    chunked and static schedulers with the paged (plain and prefix-cached) and
    contiguous allocators, recompute and swap, a tight budget and every request
    at once, every counted field of every step equals the real model
    executor's; its clock never goes backwards.
    """
    from servelab.testing.decisions import assert_same_decisions, step_rows, workload

    report = ConformanceReport("executor", _qualname(cls))
    with temporarily_registered("executor", cls) as name:
        node = _node("executor", name, cls, options)
        for scheduler, allocator, preemption in [
            (CONTINUOUS, PAGED_PREFIX, RECOMPUTE),
            (CHUNKED, PAGED, SWAP),
            (STATIC, CONTIGUOUS, RECOMPUTE),
            (CONTINUOUS, CONTIGUOUS, SWAP),
        ]:
            combo = {"scheduler": scheduler, "allocator": allocator, "preemption": preemption}
            engine = {"max_num_batched_tokens": 20} if scheduler is CHUNKED else {}
            steps = assert_same_decisions(combo, node, **engine)
            report.combinations.append(f"{_oracle().combo_id(combo)}: {steps} steps")
            report.preempted += sum(r["preempted"] for r in step_rows(combo, node, workload()))
        report.properties.append("the same scheduling decisions as executor=model, step for step")
        _check_clock(cls(**options, **_executor_context()))
        report.properties.append("now() never goes backwards; sleep() moves it on or waits")
    return report


def _executor_context() -> dict[str, Any]:
    from servelab.engine.build import engine_options
    from servelab.testing.decisions import ENGINE

    return {"model": "tiny", "hardware": None, "engine_options": engine_options(ENGINE)}


def _check_clock(executor: Any) -> None:
    before = executor.now()
    executor.sleep(0.001)
    after = executor.now()
    assert after >= before + 0.001 - 1e-9, (
        f"{type(executor).__qualname__}: sleep(0.001) moved now() from {before} to {after}"
    )


# -- property checks


def _check_exactly_once_with_aborts(report: ConformanceReport, node: dict) -> None:
    """Tight budget, one request aborted while waiting and one mid-way: every
    request finishes exactly once (`drive` asserts it), the aborted ones as
    "abort", every other one with transformers' tokens."""
    oracle = _oracle()
    case = oracle.cached_case()
    longest_prompt = max(range(len(case.prompts)), key=lambda i: len(case.prompts[i]))
    longest_output = max(range(len(case.params)), key=lambda i: case.params[i].max_tokens)
    abort = {0: longest_prompt, 3: longest_output}
    for allocator, preemption in [(PAGED, RECOMPUTE), (PAGED_PREFIX, SWAP)]:
        combo = {
            "scheduler": node,
            "allocator": allocator,
            "preemption": preemption,
            "attention": PER_REQUEST,
        }
        run = oracle.drive(case, combo, abort=abort, kv_cache_memory=TIGHT_KV_MEMORY)
        label = oracle.combo_id(combo)
        assert longest_prompt in run.aborted, f"[{label}] aborting a waiting request failed"
        for index in run.aborted:
            assert run.finish_reasons[index] == "abort", (
                f"[{label}] aborted request {index} finished as {run.finish_reasons[index]!r}"
            )
        oracle.assert_matches_reference(case, combo, run, skip=frozenset(run.aborted))
        report.combinations.append(f"{label} (aborts)")
        report.preempted += run.preempted
    report.properties.append(
        "every request finishes exactly once, with aborts, under a tight budget"
    )


def _check_victim_is_a_candidate(policy: Any) -> None:
    """`select_victim` on a few running groups returns one of them (the same list object)."""
    groups = []
    for i, (priority, arrival) in enumerate([(0, 0.0), (1, 1.0), (0, 2.0), (2, 0.5)]):
        seq = Sequence(
            f"r{i}", [1, 2, 3], SamplingParams(), arrival_time=arrival, priority=priority
        )
        groups.append(SequenceGroup(f"r{i}", seq).unfinished())
    for offered in (groups, groups[:1], groups[1:3]):
        victim = policy.select_victim(list(offered))
        assert any(victim is g for g in offered), (
            f"{type(policy).__qualname__}.select_victim returned {victim!r}, "
            f"which is none of the groups it was offered"
        )


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


@_each_declared_variant
def check_router(cls: type, **options: Any) -> ConformanceReport:
    """Checks a cluster `Router` built with `options` (servelab.testing.router_checks):
    picks in range, the same decisions on the same calls, inputs untouched."""
    from servelab.registry.construct import construct
    from servelab.testing.router_checks import REPLICA_COUNTS, check_routing

    report = ConformanceReport("router", _qualname(cls))
    with temporarily_registered("router", cls) as name:
        node = _node("router", name, cls, options)
        report.properties += check_routing(lambda n: construct("router", node, num_replicas=n))
        report.combinations += [f"{name}: {n} replicas" for n in REPLICA_COUNTS]
    return report
