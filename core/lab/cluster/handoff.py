"""One request's hand-over from a prefill instance to a decode instance, and its record.

A prefill instance serves each request as a prefill-only request (`Engine.add_prefill_request`,
servelab.engine.handover): its work is the prompt, its product the first token (DistServe's
split: the time to first token is the prefill instance's). The prompt's KV cache, `prompt
tokens x KV bytes per token`, then crosses the link to the decode instance
(`Link.transfer_seconds`), which admits it through `Engine.add_prefilled_request`: its
allocator, scheduler and preemption decide when it runs, and a request that does not fit
waits or recomputes, as configured.

The record a cluster reports is the two halves joined: arrival, queueing and first token
from the prefill side, the later tokens and the end from the decode side, plus where each
half ran, the transfer's seconds and how long the transferred request waited for admission.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from servelab.engine.engine import Engine
from servelab.engine.handover import PrefilledRequest
from servelab.engine.metrics import RequestRecord
from servelab.lab.cluster.simulated import submit
from servelab.lab.request_builder import WorkloadRequest


@dataclass
class Handoff:
    request_id: str
    prefill_replica: int
    prefilled: PrefilledRequest | None = None  # the prefill instance's product
    prefill_done: float | None = None  # the prefill instance's clock when it returned it
    kv_bytes: int = 0
    transfer_s: float = 0.0
    decode_replica: int | None = None

    @property
    def transfer_arrival(self) -> float:
        return self.prefill_done + self.transfer_s


def send(engine: Engine, req: WorkloadRequest, now: float) -> None:
    """Queues the request on its prefill instance: its prompt and first token only."""
    submit(engine.add_prefill_request, req, now)


def admit(engine: Engine, handoff: Handoff, transfer: str) -> None:
    """Queues the prefilled request on its decode instance (no K/V content: simulated)."""
    engine.add_prefilled_request(dataclasses.replace(handoff.prefilled, kv=None), transfer)


def joined_record(
    prefill: RequestRecord, decode: RequestRecord | None, handoff: Handoff
) -> tuple[RequestRecord, dict]:
    """The request's record over both instances, and its cluster columns."""
    columns = {
        "prefill_replica": handoff.prefill_replica,
        "decode_replica": handoff.decode_replica,
        "kv_transfer_bytes": handoff.kv_bytes if decode else 0,
        "transfer_s": handoff.transfer_s if decode else None,
        "transfer_wait_s": None,
    }
    if decode is None:  # one token asked for, or the first one ended it: no hand-over
        return prefill, columns
    if decode.first_scheduled_time is not None:
        columns["transfer_wait_s"] = max(
            0.0, decode.first_scheduled_time - handoff.transfer_arrival
        )
    # the decode side's sequence holds the first token as its output 0: its later tokens'
    # times are its own
    later = decode.output_tokens - 1
    record = dataclasses.replace(
        prefill,
        output_tokens=decode.output_tokens,
        finished_time=decode.finished_time,
        finish_reason=decode.finish_reason,
        preemptions=prefill.preemptions + decode.preemptions,
        token_times=prefill.token_times[:1] + decode.token_times[-later:] if later else
        prefill.token_times[:1],
        token_steps=prefill.token_steps[:1] + decode.token_steps[-later:] if later else
        prefill.token_steps[:1],
        finished_step=decode.finished_step,
        recomputed_tokens=prefill.recomputed_tokens + decode.recomputed_tokens,
        preemption_events=prefill.preemption_events + decode.preemption_events,
    )  # fmt: skip
    return record, columns
