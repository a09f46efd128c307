"""The token-exact oracle: a tiny random float64 Hugging Face checkpoint,
transformers' greedy `generate` per prompt (no padding) as the reference, and
servelab runs of any combination of parts compared against it.

A run is also an integrity check: the allocator's `check_integrity()` after
every step, every request finishing exactly once, a bounded number of steps,
and every device and host block free at the end.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import shutil
import tempfile
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from servelab.contracts.scheduler import prefills_whole_prompts
from servelab.registry.options import declared_variants
from servelab.registry.plugin_manager import lookup, registered
from servelab.step.sequence import SamplingParams
from servelab.testing.hf_reference import build_tiny_hf, hf_greedy

VOCAB = 128
MAX_MODEL_LEN = 64
KINDS = ("scheduler", "allocator", "preemption", "attention")

# Engine options of an oracle run: float64, and a KV budget tight enough that
# on-demand admission preempts.
ENGINE_OPTIONS: dict[str, Any] = dict(
    dtype="float64",
    max_model_len=MAX_MODEL_LEN,
    max_num_batched_tokens=MAX_MODEL_LEN,
    kv_cache_memory=160 * 1024,  # 160 tokens of this model's KV
    swap_space=96 * 1024,  # 96 tokens
    max_num_seqs=8,
    # a tiny model: one thread is fastest, and immune to oversubscribed cores
    num_threads=1,
)
CHUNKED_TOKEN_BUDGET = 20  # for schedulers that split prompts: chunks next to decodes


# -- the prompt set: mixed lengths, a shared long prefix, length 1, max_tokens 1
def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1234)

    def rand(n: int) -> list[int]:
        return torch.randint(4, VOCAB, (n,), generator=g).tolist()

    shared = rand(21)
    return [
        rand(1),
        rand(2),
        rand(5),
        rand(13),
        rand(30),
        shared + rand(3),
        shared + rand(9),
        shared,
        rand(17),
        shared[:16] + rand(6),
        rand(40),
        rand(8),
        rand(24),
    ]


PROMPTS = _prompts()
MAX_TOKENS = [6, 8, 1, 12, 5, 9, 7, 10, 4, 11, 6, 10, 3]


@dataclass
class OracleCase:
    """A saved checkpoint, the prompts' sampling parameters and transformers' outputs."""

    folder: Path
    prompts: list[list[int]]
    params: list[SamplingParams]
    expected: list[list[int]] = field(default_factory=list)
    eos: int = 2


def _first_new_token(run: list[int], after: int, avoid: set[int]) -> int | None:
    """A token the run reaches at step >= `after` that it did not produce before."""
    for i in range(after, len(run)):
        if run[i] not in run[:i] and run[i] not in avoid:
            return run[i]
    return None


def make_case(arch: str, folder: Path, seed: int = 0, num_kv_heads: int = 2) -> OracleCase:
    """Saves a checkpoint (4 query heads, `num_kv_heads` KV heads) whose EOS is a
    token some prompt really reaches mid-way, gives another prompt a stop token
    it hits mid-way, and records transformers' outputs for the final parameters."""
    with restored_num_threads(1):
        return _make_case(arch, folder, seed, num_kv_heads)


def _make_case(arch: str, folder: Path, seed: int, num_kv_heads: int) -> OracleCase:
    model = build_tiny_hf(arch, seed, num_kv_heads=num_kv_heads)
    free_runs = [hf_greedy(model, p, m, None) for p, m in zip(PROMPTS, MAX_TOKENS)]
    eos = next(t for run in free_runs if (t := _first_new_token(run, 2, set())) is not None)
    model.config.eos_token_id = eos
    model.generation_config.eos_token_id = eos
    model.save_pretrained(folder, safe_serialization=True)
    ignore_eos = [i % 4 == 1 for i in range(len(PROMPTS))]  # a few prompts run past EOS
    # a stop token that a prompt not stopped by EOS earlier reaches mid-way
    stop_at, stop = next(
        (i, t)
        for i, run in enumerate(free_runs)
        if eos not in run[:-1] and (t := _first_new_token(run, 2, {eos})) is not None
    )
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=m,
            stop_token_ids=[stop] if i == stop_at else [],
            ignore_eos=ignore_eos[i],
        )
        for i, m in enumerate(MAX_TOKENS)
    ]
    expected = []
    for prompt, p in zip(PROMPTS, params):
        stops = ([] if p.ignore_eos else [eos]) + p.stop_token_ids
        expected.append(hf_greedy(model, prompt, p.max_tokens, stops))
    assert any(out and out[-1] == eos for out in expected), "no prompt reaches EOS"
    assert expected[stop_at][-1] == stop and len(expected[stop_at]) < params[stop_at].max_tokens
    return OracleCase(folder, PROMPTS, params, expected, eos)


@contextlib.contextmanager
def restored_num_threads(num_threads: int | None = None) -> Iterator[None]:
    """Runs the block with `num_threads` torch threads (unchanged if None), then
    restores the count: a tiny model runs fastest on one thread, and several
    threads on an oversubscribed machine can be a hundred times slower."""
    before = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


_CASES: dict[tuple[str, int], OracleCase] = {}


def cached_case(arch: str = "qwen3", seed: int = 0) -> OracleCase:
    """`make_case` once per process, in a temporary folder removed at exit."""
    key = (arch, seed)
    if key not in _CASES:
        folder = Path(tempfile.mkdtemp(prefix=f"servelab-oracle-{arch}-"))
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        _CASES[key] = make_case(arch, folder, seed)
    return _CASES[key]


# -- combinations, enumerated from the registry
# Built-in parts are tried in the variants that matter; a part added by a
# plugin is tried in the option sets it declares (`oracle_variants`), else with
# its default options, so it is covered automatically.
VARIANTS: dict[str, dict[str, list[dict]]] = {
    "scheduler": {
        "static": [{"admission": "reserve"}],
        # order=lpm (every scheduler has it, from the base class) on one of them
        "continuous": [{"admission": "on_demand"}, {"admission": "on_demand", "order": "lpm"}],
        "chunked": [{"admission": "on_demand", "chunk_size": 8}],
        # quanta 2, 4, 8, ...; the prompts' first steps span queues 0 to 2 (skip-join)
        "mlfq": [{"base_quantum": 2, "prompt_tokens_per_step": 8, "starvation_steps": 16}],
    },
    "allocator": {
        "contiguous": [{}],
        "paged": [{"block_size": 4}, {"block_size": 4, "prefix_caching": True}],
        "radix": [{"page_size": 1}, {"page_size": 4}],
    },
    # victims of 16 computed tokens or more swap, shorter ones recompute: both paths run
    "preemption": {"hybrid": [{"break_even_tokens": 16}]},
    # flash_varlen's CPU impls: `cpu` runs its C++ kernel for the decodes (float64
    # too), `sdpa` gathers pages for one batched call; both plan prefills per sequence
    "attention": {"flash_varlen": [{"impl": "reference"}, {"impl": "sdpa"}, {"impl": "cpu"}]},
}


def variants(kind: str) -> list[dict]:
    """Every registered part of `kind`, as config nodes, in its `VARIANTS`, else in the
    option sets it declares (`declared_variants`: its defaults when it declares none)."""
    out = []
    for name in sorted(registered(kind)):
        declared = VARIANTS[kind].get(name) or declared_variants(lookup(kind, name))
        for options in declared:
            out.append({"name": name, **options})
    return out


def combinations(kinds: tuple[str, ...] = KINDS) -> list[dict]:
    """The cross product of `variants` over `kinds`: `[{kind: node}]`."""
    axes = [variants(k) for k in kinds]
    return [dict(zip(kinds, combo)) for combo in itertools.product(*axes)]


def combo_id(combo: dict) -> str:
    """`continuous|paged,block_size=4|recompute|per_request`: a readable test id."""
    parts = []
    for node in combo.values():
        extra = "".join(f",{k}={v}" for k, v in node.items() if k not in ("name", "admission"))
        parts.append(node["name"] + extra)
    return "|".join(parts)


# -- one run


@dataclass
class OracleRun:
    """What one engine run produced, and the figures a check may assert on."""

    tokens: list[list[int]]  # first sample of each request, in prompt order
    samples: list[list[list[int]]]  # every sample of each request
    finish_reasons: list[str | None]
    aborted: list[int]  # prompt indices `abort` really stopped (not already finished)
    num_steps: int
    preempted: int  # sequences preempted, summed over steps
    scheduler_stats: dict[str, float]
    evictions: int = 0  # cached KV blocks the allocator evicted (its usage's `evictions`)
    prompt_logprobs: list = field(default_factory=list)  # each request's, when asked for


def engine_options(combo: dict, **overrides: Any) -> dict[str, Any]:
    """`ENGINE_OPTIONS`, with a chunk-sized token budget for a scheduler that
    does not need whole prompts in one step, then `overrides`."""
    options = dict(ENGINE_OPTIONS)
    scheduler = combo.get("scheduler")
    if scheduler is not None:
        name = scheduler if isinstance(scheduler, str) else scheduler["name"]
        if not prefills_whole_prompts(lookup("scheduler", name)):
            options["max_num_batched_tokens"] = CHUNKED_TOKEN_BUDGET
    options.update(overrides)
    return options


def drive(
    case: OracleCase,
    combo: dict,
    *,
    check_every_step: bool = True,
    n: int = 1,
    abort: dict[int, int] | None = None,
    **engine: Any,
) -> OracleRun:
    """Runs every prompt of `case` through one engine built from `combo`.

    `n` samples per request (greedy: each must equal the reference); `abort`
    maps a step number to a prompt index aborted before that step. Raises
    AssertionError, naming the combination, when the allocator's integrity
    breaks, a request finishes twice or never, the run does not end within a
    generous step bound, or a block is still held at the end.
    """
    with restored_num_threads():  # the engine sets torch's process-wide thread count
        return _drive(case, combo, check_every_step=check_every_step, n=n, abort=abort, **engine)


def _drive(
    case: OracleCase,
    combo: dict,
    *,
    check_every_step: bool,
    n: int,
    abort: dict[int, int] | None,
    **engine: Any,
) -> OracleRun:
    from servelab import LLM  # the engine pulls in torch and every plugin

    label = combo_id(combo)
    llm = LLM(model=str(case.folder), **combo, **engine_options(combo, **engine))
    eng = llm.engine
    params = [_with_n(p, n) for p in case.params]
    # three clients in turn, so a fair scheduler has several to share between
    ids = [
        eng.add_request(p, sp, client=f"client-{i % 3}")
        for i, (p, sp) in enumerate(zip(case.prompts, params))
    ]
    # a constrained request joins the scheduler once a worker thread has compiled its
    # grammar: all join before the first step, so the schedule (and whether memory runs
    # short) never depends on that thread's pace
    if eng.grammar_queue is not None:
        futures.wait([c.future for c in eng.grammar_queue.waiting.values()])
        eng.grammar_queue.admit(eng, busy=True)
    # every step computes at least one token unless it preempts; recompute
    # repeats work, so allow several times the total work
    work = sum(len(p) + sp.max_tokens * n for p, sp in zip(case.prompts, params))
    max_steps = 4 * work + 100
    outputs: dict[str, Any] = {}
    aborted: list[str] = []
    steps = 0
    while eng.has_unfinished():
        if abort and steps in abort:
            request_id = ids[abort[steps]]
            if request_id not in outputs and eng.abort(request_id):
                aborted.append(request_id)
        if not eng.has_unfinished():
            break
        steps += 1
        assert steps <= max_steps, (
            f"[{label}] no end after {max_steps} steps; unfinished requests: "
            f"{[i for i in ids if i not in outputs and i not in aborted]}"
        )
        for out in eng.step():
            assert out.request_id in ids, (
                f"[{label}] step {steps}: unknown request {out.request_id!r}"
            )
            assert out.request_id not in outputs and out.request_id not in aborted, (
                f"[{label}] step {steps}: request {out.request_id!r} finished twice"
            )
            outputs[out.request_id] = out
        if check_every_step:
            _check_integrity(eng, f"[{label}] after step {steps}")
    never = [i for i in ids if i not in outputs and i not in aborted]
    assert not never, (
        f"[{label}] requests {never} never finished, yet the scheduler reported no unfinished "
        "work (a request was dropped)"
    )
    _check_integrity(eng, f"[{label}] at the end")
    assert_no_leak(eng.allocator, f"[{label}] after every request finished")
    records = [r.request_id for r in eng.metrics.requests]
    twice = sorted({r for r in records if records.count(r) > 1})
    assert not twice, f"[{label}] requests {twice} were recorded as finished more than once"
    finished = [outputs.get(i) for i in ids]
    stats = eng.scheduler.stats() if hasattr(eng.scheduler, "stats") else {}
    return OracleRun(
        tokens=[o.token_ids if o else [] for o in finished],
        samples=[[c.token_ids for c in o.outputs] if o else [] for o in finished],
        finish_reasons=[o.finish_reason if o else "abort" for o in finished],
        aborted=[ids.index(i) for i in aborted],
        num_steps=steps,
        preempted=sum(s.preempted for s in eng.metrics.steps),
        scheduler_stats=dict(stats),
        evictions=int(eng.allocator.usage().get("evictions", 0)),
        prompt_logprobs=[o.prompt_logprobs if o else None for o in finished],
    )


def run_engine(
    case: OracleCase, combo: dict, check_every_step: bool = True, **engine: Any
) -> list[list[int]]:
    """Every prompt's tokens from one engine (see `drive` for the checks it makes)."""
    return drive(case, combo, check_every_step=check_every_step, **engine).tokens


def assert_matches_reference(
    case: OracleCase, combo: dict, run: OracleRun, skip: frozenset[int] = frozenset()
) -> None:
    """AssertionError naming the combination, the request and the first differing token."""
    label = combo_id(combo)
    for index, (samples, want) in enumerate(zip(run.samples, case.expected)):
        if index in skip:
            continue
        for sample, got in enumerate(samples):
            if got == want:
                continue
            at = next(
                (i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want))
            )
            raise AssertionError(
                f"[{label}] request {index} (prompt of {len(case.prompts[index])} tokens), "
                f"sample {sample}: servelab produced {got} (finish reason "
                f"{run.finish_reasons[index]!r}), transformers {want}; "
                f"first difference at output token {at}"
            )


def assert_no_leak(allocator: Any, where: str) -> None:
    """AssertionError unless every device and host block of `allocator` is free."""
    usage = allocator.usage()
    held = allocator.num_blocks - usage["blocks_free"]
    assert held == 0, f"{where}: {held} of {allocator.num_blocks} device blocks leaked"
    host_total = getattr(allocator, "num_host_blocks", 0)
    host_held = host_total - usage["host_blocks_free"]
    assert host_held == 0, f"{where}: {host_held} of {host_total} host blocks leaked"


def _with_n(params: SamplingParams, n: int) -> SamplingParams:
    if n == 1:
        return params
    return SamplingParams(**{**vars(params), "n": n, "stop_token_ids": list(params.stop_token_ids)})


def _check_integrity(eng: Any, where: str) -> None:
    try:
        eng.allocator.check_integrity()
    except AssertionError as exc:
        raise AssertionError(f"{where}: allocator integrity broken: {exc}") from exc
    check = getattr(eng.scheduler, "check_integrity", None)
    if check is not None:
        try:
            check()
        except AssertionError as exc:
            raise AssertionError(f"{where}: scheduler integrity broken: {exc}") from exc
