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
from typing import Any, cast

from servelab.contracts.hookspecs import hookimpl
from servelab.contracts.kinds import KINDS
from servelab.contracts.proposer import Draft, DraftRequest, Proposer
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
PARALLEL_SAMPLING: dict[str, Any] = dict(
    n=2, kv_cache_memory=192 * 1024, max_num_batched_tokens=128
)


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
    draft_tokens: int = 0  # drafts verified over every run (proposers)
    accepted_tokens: int = 0  # of which the target kept (proposers)


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
            total.draft_tokens += report.draft_tokens
            total.accepted_tokens += report.accepted_tokens
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
    drive: Callable[..., Any] | None = None,
    **drive_options: Any,
) -> None:
    """Runs each combination through the oracle; with `refusable`, a combination
    the part refuses with ConfigError (e.g. an attention backend's `check`) is
    recorded as skipped. `drive` stands in for the oracle's (a check that
    watches the part during each run)."""
    oracle = _oracle()
    case = oracle.cached_case()
    drive = drive or oracle.drive
    for combo in combos:
        label = oracle.combo_id(combo)
        try:
            run = drive(case, combo, **drive_options)
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
        aborting = [(PAGED, RECOMPUTE), (PAGED_PREFIX, SWAP)]
        _check_exactly_once_with_aborts(
            report,
            [_combos(scheduler=node, allocator=a, preemption=p, attention=PER_REQUEST)[0]
             for a, p in aborting],
        )  # fmt: skip
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


def _check_exactly_once_with_aborts(
    report: ConformanceReport,
    combos: list[dict],
    drive: Callable[..., Any] | None = None,
) -> None:
    """Tight budget, one request aborted while waiting and one mid-way: every
    request finishes exactly once (`drive` asserts it), the aborted ones as
    "abort", every other one with transformers' tokens. `drive` stands in for
    the oracle's (a check that watches the part during each run)."""
    oracle = _oracle()
    drive = drive or oracle.drive
    case = oracle.cached_case()
    longest_prompt = max(range(len(case.prompts)), key=lambda i: len(case.prompts[i]))
    longest_output = max(range(len(case.params)), key=lambda i: case.params[i].max_tokens)
    abort = {0: longest_prompt, 3: longest_output}
    for combo in combos:
        run = drive(case, combo, abort=abort, kv_cache_memory=TIGHT_KV_MEMORY)
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


# -- proposers

RADIX = {"name": "radix"}  # page_size 1: a prefix shared down to single tokens
RADIX_PAGES = {"name": "radix", "page_size": 4}


@_each_declared_variant
def check_proposer(cls: type, **options: Any) -> ConformanceReport:
    """Checks a speculative-decoding `Proposer` built with `options`.

    Oracle runs under the kit's tight KV budget (preemption happens, with drafts
    in flight): the continuous scheduler with the paged (plain and
    prefix-cached), radix and contiguous allocators, the chunked one with the
    prefix-cached paged allocator and radix pages of 4 tokens, each under
    recompute and swap, and the static one; then aborts (a waiting request, a
    running one) and parallel sampling (n=2).
    Every request's tokens must be transformers' (verification keeps only what
    the target says), integrity must hold after every step, and every block be
    free at the end.

    Then the contract, which the core enforces by dropping a step's drafts (so a
    broken proposer would only be slow, silently): every call to `propose` is
    watched, and it must leave each `DraftRequest.token_ids` as it found it,
    return one entry per request, at most `max_drafts` Python-int ids in the
    vocabulary for each, and not raise; nor may `on_verified` or `on_finish`
    raise. A proposer that proposes must also have drafted at least once over
    the runs: one that never drafts only costs its calls, and the kit would have
    checked nothing of its drafts.
    """
    from servelab.testing.oracle import drive as oracle_drive

    report = ConformanceReport("proposer", _qualname(cls))
    with temporarily_registered("proposer", cls):  # the contract's methods, as itself
        pass
    proposer = cast("type[Proposer]", cls)  # it is one: registering it checked that
    watch = _ProposerWatch(report.part)
    name = f"under_test_{cls.__name__}"
    with temporarily_registered("proposer", _watched(proposer, watch), name=name):
        node = _node("proposer", name, cls, options)

        def drive(case: Any, combo: dict, **drive_options: Any) -> Any:
            return _drive_watched(oracle_drive, watch, report, case, combo, **drive_options)

        def with_proposer(combos: list[dict]) -> list[dict]:
            return [{**combo, "proposer": node} for combo in combos]

        _run_oracle(
            report,
            with_proposer(
                _combos(
                    scheduler=CONTINUOUS,
                    allocator=[PAGED, PAGED_PREFIX, RADIX, CONTIGUOUS],
                    preemption=[RECOMPUTE, SWAP],
                    attention=PER_REQUEST,
                )
                + _combos(
                    scheduler=CHUNKED,
                    allocator=[PAGED_PREFIX, RADIX_PAGES],
                    preemption=[RECOMPUTE, SWAP],
                    attention=PER_REQUEST,
                )
                + _combos(scheduler=STATIC, allocator=PAGED, preemption=RECOMPUTE,
                          attention=PER_REQUEST)
            ),
            drive=drive,
            kv_cache_memory=TIGHT_KV_MEMORY,
        )  # fmt: skip
        _check_exactly_once_with_aborts(
            report,
            with_proposer(
                _combos(scheduler=CONTINUOUS, allocator=PAGED_PREFIX, preemption=SWAP,
                        attention=PER_REQUEST)
                + _combos(scheduler=CHUNKED, allocator=RADIX, preemption=RECOMPUTE,
                          attention=PER_REQUEST)
            ),
            drive=drive,
        )  # fmt: skip
        _run_oracle(
            report,
            with_proposer(
                _combos(scheduler=CONTINUOUS, allocator=[PAGED_PREFIX, RADIX],
                        preemption=[SWAP, RECOMPUTE], attention=PER_REQUEST)
            ),
            drive=drive,
            **PARALLEL_SAMPLING,
        )  # fmt: skip
        report.properties.append("parallel sampling (n=2)")
    if not proposer.proposes:
        report.properties.append(
            "proposes=False: the core never asks it, every step is one without drafts"
        )
        return report
    assert report.draft_tokens > 0, (
        f"{report.part} ({_options_text(options)}) proposed no draft in any of the "
        f"{len(report.combinations)} runs ({watch.calls} calls to propose): the core verified "
        "nothing, so none of its drafts was checked, and as it is it only costs its calls. "
        "Make it draft on the oracle's requests (random prompts of a random tiny model, which "
        "often repeats itself), e.g. with options that make it less selective"
    )
    report.properties += [
        "propose leaves DraftRequest.token_ids as it found them",
        "one entry per request, at most max_drafts token ids each, all in the vocabulary",
        "propose, on_verified and on_finish never raise",
        f"{report.draft_tokens} drafts verified, {report.accepted_tokens} accepted, "
        f"{report.preempted} preemptions",
    ]
    return report


class _ProposerWatch:
    """What the proposer under test did against its contract, over every engine
    the kit builds with it (each builds its own instance): the first breach of
    each rule, and how often the rule was broken."""

    def __init__(self, part: str) -> None:
        self.part = part
        self.first: dict[str, str] = {}  # rule -> its first breach, described
        self.count: dict[str, int] = {}
        self.calls = 0

    def breaks(self, rule: str, what: str) -> None:
        self.first.setdefault(rule, what)
        self.count[rule] = self.count.get(rule, 0) + 1

    def failure(self, label: str) -> AssertionError | None:
        if not self.first:
            return None
        breaches = [
            what + (f" (and {self.count[rule] - 1} more times)" if self.count[rule] > 1 else "")
            for rule, what in self.first.items()
        ]
        return AssertionError(
            f"[{label}] {self.part} breaks the proposer contract: " + "; ".join(breaches)
        )


def _drive_watched(
    drive: Callable[..., Any],
    watch: _ProposerWatch,
    report: ConformanceReport,
    case: Any,
    combo: dict,
    **drive_options: Any,
) -> Any:
    """The oracle's `drive`, then the contract: a rule the proposer broke is the
    failure (rather than what it caused: a token mismatch, a crashed engine)."""
    label = _oracle().combo_id(combo)
    try:
        run = drive(case, combo, **drive_options)
    except Exception as exc:
        failure = watch.failure(label)
        if failure is not None:
            raise failure from exc
        raise
    failure = watch.failure(label)
    if failure is not None:
        raise failure
    errors = int(run.scheduler_stats.get("spec_proposer_errors", 0))
    assert errors == 0, (
        f"[{label}] the core rejected {report.part}'s drafts in {errors} steps (its "
        "`ProposerError`s are logged): they were dropped, so the proposer only slowed the run"
    )
    report.draft_tokens += int(run.scheduler_stats.get("spec_num_draft_tokens", 0))
    report.accepted_tokens += int(run.scheduler_stats.get("spec_num_accepted_tokens", 0))
    return run


def _watched(cls: type[Proposer], watch: _ProposerWatch) -> type:
    """`cls` with its calls watched: `propose` checked against the contract
    (what it broke goes to `watch`; a token list it changed is put back, so the
    run goes on to the end and the rule is the failure), and any exception the
    proposer raises recorded before the core sees it."""
    from servelab.testing.oracle import VOCAB

    def propose(self: Any, requests: list[DraftRequest]) -> Any:
        watch.calls += 1
        before = [list(r.token_ids) for r in requests]
        try:
            answers = cls.propose(self, requests)
        except Exception as exc:
            watch.breaks(
                "raises",
                f"propose raised {type(exc).__name__}: {exc} (a proposer must not raise; the "
                "core drops that step's drafts)",
            )
            raise
        finally:
            _check_untouched(requests, before, watch)
        _check_answers(cls.__qualname__, requests, answers, VOCAB, watch)
        return answers

    def on_verified(self: Any, seq_id: int, drafted: int, accepted: int) -> None:
        try:
            cls.on_verified(self, seq_id, drafted, accepted)
        except Exception as exc:
            watch.breaks("raises", f"on_verified raised {type(exc).__name__}: {exc}")
            raise

    def on_finish(self: Any, seq_id: int) -> None:
        try:
            cls.on_finish(self, seq_id)
        except Exception as exc:
            watch.breaks("raises", f"on_finish raised {type(exc).__name__}: {exc}")
            raise

    namespace = {
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
        "__doc__": cls.__doc__,
        "propose": propose,
        "on_verified": on_verified,
        "on_finish": on_finish,
    }
    return type(cls.__name__, (cls,), namespace)


def _check_untouched(requests: list[Any], before: list[list[int]], watch: _ProposerWatch) -> None:
    for request, tokens in zip(requests, before):
        now = list(request.token_ids)
        if now == tokens:
            continue
        at = next((i for i, (a, b) in enumerate(zip(now, tokens)) if a != b), None)
        change = (
            f"its {len(tokens)} tokens became {len(now)}"
            if at is None
            else f"its token at position {at} went from {tokens[at]} to {now[at]}"
        )
        watch.breaks(
            "token_ids",
            f"propose changed DraftRequest.token_ids of request {request.request_id!r} (seq "
            f"{request.seq_id}): {change}; they are the sequence's own tokens, read-only to a "
            "proposer (copy them to change them)",
        )
        if isinstance(request.token_ids, list):  # put them back: the run goes on
            request.token_ids[:] = tokens


def _check_answers(
    owner: str, requests: list[Any], answers: Any, vocab: int, watch: _ProposerWatch
) -> None:
    if not isinstance(answers, (list, tuple)) or len(answers) != len(requests):
        got = (
            f"{len(answers)} entries"
            if isinstance(answers, (list, tuple))
            else (f"a {type(answers).__name__}")
        )
        watch.breaks(
            "one entry per request",
            f"{owner}.propose returned {got} for {len(requests)} requests; it must return "
            "one entry per request, in order (a list of token ids, a Draft, or None)",
        )
        return
    for request, answer in zip(requests, answers):
        tokens = answer.tokens if isinstance(answer, Draft) else answer
        where = f"{owner}.propose gave request {request.request_id!r} (seq {request.seq_id})"
        if tokens is None:
            continue
        if not isinstance(tokens, (list, tuple)):
            watch.breaks(
                "entry type",
                f"{where} a {type(tokens).__name__}; an entry is a list of token ids, a Draft "
                "or None (a tensor or array: call .tolist())",
            )
            continue
        if len(tokens) > request.max_drafts:
            watch.breaks(
                "max_drafts",
                f"{where} {len(tokens)} drafts, more than its max_drafts={request.max_drafts} "
                "(the core's cap: k, the adaptive cap and the tokens the request may still "
                "produce)",
            )
        wrong = [t for t in tokens if type(t) is not int or not 0 <= t < vocab]
        if wrong:
            bad = wrong[0]
            what = (
                "outside the vocabulary"
                if type(bad) is int
                else f"of type {type(bad).__module__}.{type(bad).__qualname__}"
            )
            watch.breaks(
                "token ids",
                f"{where} the draft token {bad!r}, {what}: token ids are Python ints in "
                f"[0, vocab_size={vocab})",
            )


def _options_text(options: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in options.items()) or "its default options"
