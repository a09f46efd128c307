"""Disaggregated oracle runs: the prompts of an `OracleCase` prefilled by one engine and
decoded by another, in one process, stepped in turn as two instances would run.

`run_disaggregated` hands each finished prefill (`Engine.take_prefilled`) to the decode
engine (`Engine.add_prefilled_request`) right after the step that produced it, so a
transfer can arrive while the decode engine is full; `transport` (identity by default)
stands for the wire: the two-process path passes the K/V through torch.distributed.
Integrity is checked on both engines after every step, and no block may be held at the
end. The tokens must equal transformers' (`OracleCase.expected`) and a colocated run's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from servelab.engine.handover import PrefilledRequest
from servelab.testing.oracle import (
    OracleCase,
    _check_integrity,
    assert_no_leak,
    combo_id,
    engine_options,
    restored_num_threads,
)


@dataclass
class DisaggregatedRun:
    tokens: list[list[int]]  # each prompt's output tokens, in prompt order
    finish_reasons: list[str | None]
    handed_over: int  # requests the decode engine received
    max_waiting: int  # most prefilled requests left waiting for admission after a decode step
    decode_preempted: int  # sequences preempted on the decode engine
    decode_stats: dict[str, float] = field(default_factory=dict)


def build_pair(case: OracleCase, combo: dict, decode_overrides: dict | None = None, **engine):
    """A prefill engine and a decode engine of the same model and parts."""
    from servelab import LLM  # the engine pulls in torch and every plugin

    options = engine_options(combo, **engine)
    prefill = LLM(model=str(case.folder), **combo, **options).engine
    decode = LLM(model=str(case.folder), **combo, **{**options, **(decode_overrides or {})}).engine
    return prefill, decode


def run_disaggregated(
    case: OracleCase,
    combo: dict,
    *,
    transfer: str = "wait",
    decode_overrides: dict | None = None,
    transport: Callable[[PrefilledRequest], PrefilledRequest] | None = None,
    **engine: Any,
) -> DisaggregatedRun:
    with restored_num_threads():
        prefill, decode = build_pair(case, combo, decode_overrides, **engine)
        return drive_pair(case, combo, prefill, decode, transfer, transport)


def drive_pair(case, combo, prefill, decode, transfer="wait", transport=None) -> DisaggregatedRun:
    label = combo_id(combo)
    ids = [prefill.add_prefill_request(p, sp) for p, sp in zip(case.prompts, case.params)]
    outputs: dict[str, Any] = {}
    handed = max_waiting = steps = 0
    max_steps = 8 * sum(len(p) + sp.max_tokens for p, sp in zip(case.prompts, case.params)) + 100
    while prefill.has_unfinished() or decode.has_unfinished():
        steps += 1
        assert steps <= max_steps, f"[{label}] no end after {max_steps} steps"
        if prefill.has_unfinished():
            prefill_outputs = {o.request_id: o for o in prefill.step()}
            _check_integrity(prefill, f"[{label}] prefill engine, step {steps}")
            for request in prefill.take_prefilled():
                if request.done:  # the first token ended it: the prefill output is final
                    outputs[request.request_id] = prefill_outputs[request.request_id]
                    continue
                decode.add_prefilled_request(transport(request) if transport else request, transfer)
                handed += 1
        if decode.has_unfinished():
            for out in decode.step():
                assert out.request_id not in outputs, f"[{label}] {out.request_id} finished twice"
                outputs[out.request_id] = out
            _check_integrity(decode, f"[{label}] decode engine, step {steps}")
        # transfers a step of the decode engine could not admit: they wait for room
        waiting = decode.scheduler.stats().get("prefilled_waiting", 0)
        max_waiting = max(max_waiting, int(waiting))
    missing = [i for i in ids if i not in outputs]
    assert not missing, f"[{label}] requests {missing} never finished"
    for name, eng in (("prefill", prefill), ("decode", decode)):
        assert_no_leak(eng.allocator, f"[{label}] {name} engine at the end")
    return DisaggregatedRun(
        tokens=[outputs[i].outputs[0].token_ids for i in ids],
        finish_reasons=[outputs[i].outputs[0].finish_reason for i in ids],
        handed_over=handed,
        max_waiting=max_waiting,
        decode_preempted=sum(s.preempted for s in decode.metrics.steps),
        decode_stats=dict(decode.scheduler.stats()),
    )
